"""Every instance's rollout engine, one clock tick at a time (engine.py ticks it): admission, iterations, turn ends."""

from __future__ import annotations

import numpy as np

from rose.services.executor.metrics import PREFILL_RATE_EMA

from .co_batched import CoBatchPlan
from .counters import Counters
from .instances import Instances
from .sizing import SizedFleet
from .trainer_state import TrainerState
from .turns import TurnTable


class RolloutEngines:
    """The rollout engines of every instance as the executor runs them: admission FIFO per instance under its slot and
    KV caps, then iterations, each one packed forward with the decode step of the running turns and a prefill chunk
    (the executor's rollout chunk) for the turns still prefilling (``mixed_s``), at the share of the device the tick
    gives rollout; a turn ends at its interpolated time inside the tick.

    It exists to keep what the engines did in the tick that the monitor reports (the turns running and queued as
    admission left them, the share of the device rollout's forwards got lately) with the model that produces it, and
    the policy's step model per instance in one place (the turns' prefill and cache costs read it too).
    """

    def __init__(self, sized: SizedFleet, inst: Instances, turns: TurnTable, trainer: TrainerState, counts: Counters, lane_pool_share) -> None:
        self.sized, self.inst, self.turns, self.trainer, self.counts = sized, inst, turns, trainer, counts
        # the lane pool's run: per second, the share of its serving instance's time each lane instance gets (None: no lanes)
        self.lane_pool_share: np.ndarray | None = lane_pool_share
        # per instance, rollout turns running and queued as its last admission left them (``tick``)
        self.admitted_view = (np.zeros(inst.D, dtype=np.int64), np.zeros(inst.D, dtype=np.int64))
        # per instance, the share of its device rollout's forwards got lately (a moving mean, as the executor's prefill rate)
        self.share_seen = np.ones(inst.D)

    # ------------------------------------------------------------------ the policy's step model per instance
    def policy_steps(self, d: int):
        """The policy's step model on instance ``d`` (``policy_perf`` picks it per instance for arrays)."""
        return self.sized.shape.pperf_s if self.inst.on_serving_gpus[d] else self.sized.shape.pperf_d

    def policy_perf(self, d: np.ndarray, fn: str, *args):
        a = getattr(self.sized.shape.pperf_d, fn)(*args)
        b = getattr(self.sized.shape.pperf_s, fn)(*args)
        return np.where(self.inst.on_serving_gpus[d], b, a)

    # ------------------------------------------------------------------ what the monitor reads
    def turns_by_state(self) -> tuple[np.ndarray, np.ndarray]:
        """Per instance, rollout turns (rows) running and queued now."""
        t, D = self.turns, self.inst.D
        if t.N == 0:
            return np.zeros(D, dtype=np.int64), np.zeros(D, dtype=np.int64)
        return np.bincount(t.dev[t.state == 2], minlength=D), np.bincount(t.dev[t.state == 1], minlength=D)

    def prefill_rates(self) -> np.ndarray:
        """Per instance, the prompt tokens/s of a rollout forward that carries a prefill chunk beside the decode steps
        running there, from its step model, at the share of the device its rollout got lately: what an executor
        reports as ``rollout_prefill_tokens_per_s``, timing its forwards by the wall clock, serving's turns between
        included (services/executor/emulated.py yields a rollout forward to serving ones). The device's rate alone
        read a lane 2.4x its measured rate (docs/benchmarks.md, 2026-12-05 (evening 2))."""
        t, D, shape = self.turns, self.inst.D, self.sized.shape
        run = t.state == 2
        rows = np.bincount(t.dev[run], minlength=D).astype(float)
        ctx = np.bincount(t.dev[run], weights=t.ctx[run], minlength=D) / np.maximum(rows, 1.0)
        chunk = np.where(self.inst.on_serving_gpus, shape.pperf_s.rollout_prefill_tokens, shape.pperf_d.rollout_prefill_tokens).astype(float)
        alone = chunk / np.maximum(self.policy_perf(np.arange(D), "mixed_s", rows * t.bundle, np.maximum(ctx, 1.0), chunk), 1e-12)
        return alone * self.share_seen

    # ------------------------------------------------------------------ the tick
    def shares(self, now: float, serving_lanes: np.ndarray | None) -> np.ndarray:
        """What each instance's rollout engine gets of this second: a dedicated (or lane) instance the whole device once
        it has the current weights (a lane instance its serving instance's lane share), a serving instance
        ``serving_lanes`` (None: no rollout there)."""
        inst, n = self.inst, self.inst.n_serv
        share = np.zeros(inst.D)
        share[n:] = (inst.ready_at[n:] <= now).astype(float)
        if self.lane_pool_share is not None:
            share[inst.is_lane] *= float(self.lane_pool_share[min(len(self.lane_pool_share) - 1, int(now))])
        if serving_lanes is not None:
            share[:n] = serving_lanes
        return share

    def tick(self, now: float, dt: float, share: np.ndarray, co_plan: CoBatchPlan | None) -> np.ndarray:
        """One tick of every engine at ``share`` of its device (``co_plan``: the co-batched serving instances' rows in
        serving's iterations, co_batched.py); the rollout tokens each generated."""
        t = self.turns
        if t.N == 0 or not t.state.any():
            self.admitted_view = self.turns_by_state()
            return np.zeros(self.inst.D)
        self._admit(now)
        self.admitted_view = self.turns_by_state()
        run = np.flatnonzero(t.state == 2)
        if run.size == 0:
            return np.zeros(self.inst.D)
        tokens = self._advance(now, dt, share, co_plan, run)
        rolling = self.admitted_view[0] > 0  # the device share its forwards got, where rollout ran this tick
        self.share_seen[rolling] += PREFILL_RATE_EMA * (share[rolling] - self.share_seen[rolling])
        return tokens

    def _admit(self, now: float) -> None:
        """Admission, FIFO per instance under the slot and KV caps; a turn that can never fit there is refused."""
        inst, t, D = self.inst, self.turns, self.inst.D
        bundle, kvb = t.bundle, self.sized.memory.kvb_p
        q = np.flatnonzero(t.state == 1)
        if q.size:
            dq = t.dev[q]
            need = bundle * (t.ctx[q] + t.dec_left[q]) * kvb
            never = need > inst.kvcap[dq]
            for i in q[never]:  # can never fit there (or no rollout pool at all): the executor refuses, the worker goes elsewhere
                t.state[i], t.dev[i] = 0, -1
                self.counts.turns.bounced += 1
                t.events[i].succeed(("bounced", 0.0))
            keep = ~never
            q, dq, need = q[keep], dq[keep], need[keep]
        if q.size:
            order = np.lexsort((t.seq[q], dq))
            q, dq, need = q[order], dq[order], need[order]
            run = t.state == 2
            used_slots = (np.bincount(t.dev[run], minlength=D) * bundle) if run.any() else np.zeros(D)
            used_kv = np.bincount(t.dev[run], weights=bundle * (t.ctx[run] + t.dec_left[run]) * kvb, minlength=D) if run.any() else np.zeros(D)
            pos = np.arange(q.size)
            first = np.r_[True, dq[1:] != dq[:-1]]
            start = np.maximum.accumulate(np.where(first, pos, 0))
            cs = np.cumsum(np.full(q.size, float(bundle)))
            ck = np.cumsum(need)
            cs_g = cs - cs[start] + bundle
            ck_g = ck - ck[start] + need[start]
            ok = (used_slots[dq] + cs_g <= inst.slots[dq]) & (used_kv[dq] + ck_g <= inst.kvcap[dq]) & (inst.ready_at[dq] <= now)
            adm = q[ok]
            if adm.size:
                t.state[adm] = 2
                t.pf_left[adm] = bundle * t.pf_tokens[adm]  # prefill tokens left

    def _advance(self, now: float, dt: float, share: np.ndarray, co_plan: CoBatchPlan | None, run: np.ndarray) -> np.ndarray:
        """The running turns (``run``) as the executor iterates: each iteration one packed forward, the decode step of
        the running turns plus a prefill chunk for the turns still prefilling; once the prefills are done, decode steps
        alone. The tokens each instance generated."""
        inst, t, acc, D = self.inst, self.turns, self.counts, self.inst.D
        shape, bundle = self.sized.shape, t.bundle
        dr = t.dev[run]
        pf = t.pf_left[run]
        pre = pf > 1e-9
        dec = ~pre
        PF = np.bincount(dr[pre], weights=pf[pre], minlength=D)
        cached_d = np.bincount(dr[pre], weights=t.pf_cached[run][pre] * pf[pre], minlength=D) / np.maximum(PF, 1e-30)
        ndec = np.bincount(dr[dec], minlength=D)
        nb = ndec * bundle
        ctx_d = np.maximum(np.bincount(dr[dec], weights=t.ctx[run][dec], minlength=D) / np.maximum(ndec, 1), 1.0)
        chunk = np.where(inst.on_serving_gpus, shape.pperf_s.rollout_prefill_tokens, shape.pperf_d.rollout_prefill_tokens)
        c = np.minimum(chunk, PF)
        tau_mix = self.policy_perf(np.arange(D), "mixed_s", nb, ctx_d, c, cached_d)
        tau = self.policy_perf(np.arange(D), "decode_s", np.maximum(nb, 1), ctx_d)
        T = share * dt
        n_mix = np.where(PF > 0, np.minimum(PF / np.maximum(c, 1e-30), T / np.maximum(tau_mix, 1e-30)), 0.0)
        n_it = n_mix + np.where(nb > 0, np.maximum(T - n_mix * tau_mix, 0.0) / tau, 0.0)
        device_s = np.where(nb > 0, T, np.minimum(T, n_mix * tau_mix))  # decode fills the tick
        chunks = n_mix * c  # prompt tokens the instance's rollout prefills this tick
        if co_plan is not None:  # co-batched serving instances: rollout rides serving's iterations (co_batched.py)
            n = inst.n_serv
            row_tokens, prefill, added = co_plan.per_second()
            n_it[:n] = np.where(nb[:n] > 0, row_tokens * dt / np.maximum(nb[:n], 1), 0.0)  # tokens per row this tick
            chunks[:n], device_s[:n] = prefill * dt, added * dt
        acc.rollout.device_s += float(device_s.sum())
        self._prefill(run, dr, pf, pre, chunks)
        adv = np.where(dec, n_it[dr], 0.0)
        left = t.dec_left[run]
        step_tokens = np.minimum(left, adv)
        t.dec_left[run] = left - step_tokens
        t.ctx[run] += step_tokens
        tokens = np.bincount(dr, weights=step_tokens * bundle, minlength=D)
        acc.rollout.rollout_tokens += float(tokens.sum())
        acc.rollout.serving_tokens += float(tokens[: inst.n_serv].sum())
        if self.lane_pool_share is not None:
            acc.rollout.lane_pool_tokens += float(tokens[inst.is_lane].sum())
        fin_mask = dec & (left - adv <= 1e-9) & (adv > 0)
        if fin_mask.any():
            self._finish(run[fin_mask], left[fin_mask], adv[fin_mask], now, dt)
        return tokens

    def _prefill(self, run: np.ndarray, dr: np.ndarray, pf: np.ndarray, pre: np.ndarray, chunks: np.ndarray) -> None:
        """Each instance's prefill ``chunks`` go to its prefilling turns in admission order, as the engine's budget does
        (scheduling.py)."""
        t = self.turns
        ids = np.flatnonzero(pre)
        ids = ids[np.lexsort((t.seq[run][ids], dr[ids]))]
        want = pf[ids]
        before = np.cumsum(want) - want
        first = np.r_[True, dr[ids][1:] != dr[ids][:-1]] if ids.size else np.zeros(0, dtype=bool)
        before -= before[np.maximum.accumulate(np.where(first, np.arange(ids.size), 0))] if ids.size else 0.0
        took = np.clip(chunks[dr[ids]] - before, 0.0, want)
        new_pf = np.zeros(run.size)
        new_pf[ids] = np.where(want - took <= 1e-9, 0.0, want - took)
        t.pf_left[run] = new_pf

    def _finish(self, fins: np.ndarray, left: np.ndarray, adv: np.ndarray, now: float, dt: float) -> None:
        """Turns ``fins`` end inside the tick, at the time their last token took (``left`` of ``adv`` tokens): their
        context stays cached where they ran, computed by the version that instance had then."""
        t, kvb = self.turns, self.sized.memory.kvb_p
        frac_t = np.clip(left / np.maximum(adv, 1e-12), 0.0, 1.0)
        at = now + dt * frac_t
        for i, t_fin in zip(fins, at):
            t.finish(i, kvb, self.trainer.version_at(not self.inst.on_serving_gpus[t.dev[i]], float(t_fin)), float(t_fin))
            t.events[i].succeed(("done", float(t_fin)))
