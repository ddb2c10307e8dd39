"""The simulated rollout worker: its own state and the process of each trajectory the trainer hands out (trainer.py)."""

from __future__ import annotations

import math
import statistics
from collections import deque

import simpy

from rose.shared.turns.hedging import hedge_ask_again_after

from .clock import Clock
from .config import SimConfig
from .counters import Counters
from .instances import Instances
from .rollout import RolloutEngines
from .routing import Router
from .sizing import SizedFleet
from .trainer_state import TrainerState
from .turns import TurnTable

# rollout worker defaults (shared/turns/settings.py, runner.py)
HEDGE_MIN_S = 2.0
HEDGE_FACTOR = 1.5
TYPICAL_WINDOW = 64


class RolloutWorker:
    """The rollout worker (services/rollout_worker, shared/turns/runner.py): its episode slots (``worker_concurrency``
    trajectories at a time, first handed out first; None: unbounded), its window of recent turn times behind the
    straggler timer, and the process of each trajectory: route a turn (the scheduler's ``place_turn`` over its
    ``Fleet``, ``Router``), wait for it, run the tool, next turn; an interrupted turn resumes elsewhere with its tokens
    (recompute), a refused one goes elsewhere, a straggler asks the scheduler for a hedge and the first result wins.

    It exists because the slots and the window carry over from turn to turn and batch to batch, while everything else
    a trajectory needs is its own (its process's locals), the scheduler's or the turn table's.
    """

    def __init__(
        self,
        env: simpy.Environment,
        cfg: SimConfig,
        clock: Clock,
        sized: SizedFleet,
        inst: Instances,
        turns: TurnTable,
        router: Router,
        rollout: RolloutEngines,
        trainer: TrainerState,
        counts: Counters,
    ) -> None:
        self.env, self.cfg, self.clock = env, cfg, clock
        self.sized, self.inst, self.turns, self.router = sized, inst, turns, router
        self.rollout, self.trainer, self.counts = rollout, trainer, counts
        self.episodes: simpy.Resource | None = None
        self.durations: deque[float] = deque(maxlen=TYPICAL_WINDOW)

    def size(self, concurrency: int | None, bundle: int) -> None:
        """Episode slots for ``concurrency`` trajectories, of which each simulated one is ``bundle``."""
        self.episodes = simpy.Resource(self.env, capacity=max(1, concurrency // max(1, bundle))) if concurrency else None

    def typical(self) -> float:
        """The rollout worker's typical turn time: the median of its last 64 turns (4 at least)."""
        return statistics.median(self.durations) if len(self.durations) >= 4 else 0.0

    def hedge_at(self, now: float, typical: float, leased: bool = False) -> float | None:
        """When a turn started ``now`` becomes a straggler: max(2 s, 1.5 x the typical turn); before any is known,
        2 s for a turn on leased capacity (a burst may park it) and None for one on a dedicated executor."""
        if typical > 0 or leased:
            return now + max(HEDGE_MIN_S, HEDGE_FACTOR * typical)
        return None

    # ------------------------------------------------------------------ processes
    def trajectory(self, step: int, i: int, batch, slot: int | None = None, info: dict | None = None):
        """One trajectory of ``batch`` (its row ``i``) in turn-table ``slot`` (default ``i``); ``info``:
        the pipelined trainer's record of the batch (first turn start, group completions)."""
        env = self.env
        slot = i if slot is None else slot
        episodes, req = self.episodes, None
        if episodes is not None:  # the rollout worker runs a bounded number of episodes, first handed out first
            req = episodes.request()
            yield req
        tid, gid = f"t{step}-{i}", f"g{step}-{i // max(1, self.cfg.rollout.group_size)}"
        ctx = int(batch.prompt[i])
        prev = ""
        turns = int(batch.turns[i])
        finish = env.now
        done_turns: list[tuple[int, int, float]] = []
        for k in range(turns):
            new_tokens = ctx if k == 0 else int(batch.tool_tokens[i, k - 1])
            started = env.now
            if info is not None and info["first"] is None:
                info["first"] = started
            finish, d = yield from self.turn(slot, tid, gid, k, ctx, new_tokens, float(batch.gen[i, k]), prev, (f"b{step}", batch.n))
            self.durations.append(finish - started)
            self.counts.rollout.turn_durations.append(finish - started)
            done_turns.append((k, int(batch.gen[i, k]), finish - started))
            ctx += int(batch.gen[i, k])
            prev = self.inst.ids[d]
            if k + 1 < turns:
                ctx += int(batch.tool_tokens[i, k])
                wait = float(batch.tool_s[i, k]) - (env.now - finish)
                if wait > 0:
                    yield env.timeout(wait)
            else:
                self.turns.finished_at[slot] = finish
        self.turns.drop_cache(slot)
        self.router.fleet.on_trajectory(tid, gid, [int(x) for x in batch.gen[i, :turns]])
        for k, tokens, seconds in done_turns:  # the scheduler reads the turn records of a finished trajectory
            self.router.fleet.on_turn_result(tid, k, tokens, seconds)
        if episodes is not None and req is not None:
            episodes.release(req)
        if info is not None:
            self.trainer.trajectory_done(info, i, finish, self.cfg.trajectory_fetch_s)

    def turn(self, i: int, tid: str, gid: str, k: int, ctx: int, new_tokens: int, gen: float, prev: str, bid: tuple[str, int] = ("", 0)):
        """One turn as the rollout worker runs it (shared/turns/runner.py): route, generate;
        an interrupted attempt resumes elsewhere with its tokens; a bounced one goes elsewhere; a
        straggler gets a hedge when the scheduler's ``should_hedge`` agrees; the first result wins.
        Returns (finish time, device)."""
        env, t, ids = self.env, self.turns, self.inst.ids
        done_tokens = 0.0
        exclude: list[str] = []
        retry = self.router.settings.no_route_retry_s
        while True:
            routed = self.router.route(env.now, self.clock.ticks, tid, gid, k, ctx + done_tokens, prev, exclude, bid)
            if routed is None:
                exclude = []
                yield env.timeout(retry)
                continue
            d, hint = routed
            cached, load_s = self.cached(i, d, ctx + done_tokens)
            if load_s > 0:  # the prefix comes back from the host tier before the turn is admitted
                self.counts.turns.host_hits += 1
                self.counts.turns.host_load_s += load_s
                yield env.timeout(load_s)
            if k > 0 and done_tokens == 0:
                self._count_prefix(d, ctx, new_tokens, cached, prev)
            pending = {i: (self._submit(i, d, ctx + done_tokens - cached, cached, gen - done_tokens, ctx + done_tokens), d)}
            typical = self.typical()
            leased = self.router.fleet.role_of(ids[d]) != "dedicated"
            hedge_at = self.hedge_at(env.now, typical, leased)
            if hint > 0:  # the scheduler's hint for a turn on leased capacity: past its predicted time there, it is late
                hedge_at = min(hedge_at if hedge_at is not None else math.inf, env.now + hint)
            attempt_start = env.now
            failed: list[str] = []
            while pending:
                waits = [ev for ev, _ in pending.values()]
                if hedge_at is not None and len(pending) == 1 and i in pending:
                    waits.append(env.timeout(max(0.0, hedge_at - env.now)))
                yield simpy.AnyOf(env, waits)
                for slot, (ev, dd) in list(pending.items()):
                    if not ev.triggered:
                        continue
                    kind, value = ev.value
                    del pending[slot]
                    if kind == "done":
                        for other in pending:
                            t.cancel(other)  # the slower copy of a hedged turn: the worker ignores it; the executor drops it
                        if slot != i:
                            self.counts.turns.hedge_wins += 1
                            t.move_cache(slot, i)
                        return value, dd
                    if kind == "interrupted" and slot == i:
                        done_tokens += value
                    failed.append(ids[dd])
                if hedge_at is not None and env.now >= hedge_at and i in pending and len(pending) == 1:
                    primary = ids[pending[i][1]]
                    h = self.router.hedge(
                        env.now, self.clock.ticks, tid, gid, k, ctx + done_tokens, primary, prev, env.now - attempt_start, typical, bid
                    )
                    # refused: a turn on leased capacity asks again once its age has doubled (hedging.hedge_ask_again_after)
                    hedge_at = env.now + hedge_ask_again_after(env.now - attempt_start) if h is None and leased else None
                    if h is not None:
                        self.counts.turns.hedges += 1
                        slot = t.N + i
                        hc, _ = self.cached(i, h, ctx + done_tokens, host=False)  # the hedge takes the trajectory's entry there
                        pending[slot] = (self._submit(slot, h, ctx + done_tokens - hc, hc, gen - done_tokens, ctx + done_tokens), h)
            exclude += [e for e in failed if e not in exclude]  # the worker's exclude list grows until no route is left
            prev = ""

    def _count_prefix(self, d: int, ctx: int, new_tokens: int, cached: float, prev: str) -> None:
        """A later turn's first attempt on instance ``d``: its prefix found cached there or not, and the prefill it
        redoes beyond its new tokens (the context its cache no longer holds)."""
        turns = self.counts.turns
        if cached:
            turns.prefix_hits += 1
        else:
            turns.prefix_misses += 1
        turns.prefix_cached_tokens += cached
        turns.prefix_reusable_tokens += min(ctx - new_tokens, ctx - 1)
        perf = self.rollout.policy_steps(d)
        redone = float(perf.prefill_s(ctx - cached, cached) - perf.prefill_s(new_tokens, ctx - new_tokens))
        if redone > 0:
            turns.reprefill_s += redone
            if self.inst.ids[d] != prev:
                turns.reprefill_moved_s += redone

    def cached(self, i: int, d: int, prompt: float, host: bool = True) -> tuple[float, float]:
        """(prompt tokens of trajectory row ``i`` that instance ``d`` still holds, seconds to copy them back from its
        host tier). As the executor's ``PrefixCache.take`` and ``HostTier.take``: the entry an earlier turn left there,
        taken (hit or miss), if the instance's policy version is the one that computed it and eviction (oldest first,
        ``TurnTable.where``) has not taken it from the device, else from the host tier too; at least one prompt token
        is left to compute. ``host=False`` (a hedge: its primary may finish before a copy would) leaves a host copy."""
        t, m = self.turns, self.sized.memory
        if t.cache_tokens[i, d] <= 0:  # none there (most routes of a moved turn): nothing to take, no KV to sum
            return 0.0, 0.0
        ded = not self.inst.on_serving_gpus[d]  # the pool's KV and weights, else a serving GPU's lent KV and link
        host_cap = self.cfg.host_kv_ratio * (m.dedicated_kv if ded else max(0.0, m.cohost_free_bytes))
        where = t.where(i, d, t.kv_in_use(d, m.kvb_p), float(self.inst.kvcap[d]), host_cap)
        if where == "host" and not host:
            return 0.0, 0.0
        held, version = t.take(i, d)
        if not where or version != self.trainer.version_at(ded, self.env.now):
            return 0.0, 0.0
        cached = float(min(held, prompt - 1.0))
        if where == "device":
            return cached, 0.0
        return cached, float(self.rollout.policy_steps(d).host_load_s(cached)) * t.bundle

    def _submit(self, i: int, d: int, pf_tokens: float, cached: float, gen_left: float, ctx_now: float):
        """Turn-table row ``i`` goes to instance ``d``; the event its worker waits on."""
        ev = self.env.event()
        self.turns.submit(i, d, ev, pf_tokens, cached, gen_left, ctx_now)
        return ev
