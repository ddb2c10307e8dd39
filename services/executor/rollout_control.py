"""Rollout control, SGLang-style: pause and continue, abort, flush retained prefixes, release and resume memory.

Why its own object: these are the admin calls RL frameworks make on an inference server (slime, verl and
AReaL call SGLang's ``/pause_generation``, ``/release_memory_occupation`` and the rest; sglang_api.py
answers them from this object), and each must take effect between iterations, never inside a batch.
So a call here is queued (``between_iterations``) and carried out by the thread that runs rollout iterations at
its next boundary (``run_pending``), which resolves the call's future; with no such thread running (not
started, stopping, a policy without rollout) it is carried out at once.

The flags a lane reads on every iteration (``paused``, ``released``) are set by the call itself, so a
pause holds from the moment it is asked, not from the moment it is carried out.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable

from .batcher import Batcher
from .protocol import InvalidRequest

PAUSE_MODES = ("abort", "retract", "in_place")  # as SGLang's /pause_generation
MEMORY_TAGS = ("kv_cache", "weights")  # as SGLang's /release_memory_occupation


class RolloutControl:
    """Pause, abort, flush, release and resume the rollout side of an engine, between its iterations."""

    def __init__(
        self,
        rollout: Batcher,
        *,
        offload_weights: Callable[[], int] | None,
        reload_weights: Callable[[], int] | None,
        runs_now: Callable[[], bool],
    ) -> None:
        self._rollout = rollout
        self._offload, self._reload = offload_weights, reload_weights  # None: the policy's weights cannot leave (co-batched)
        self._runs_now = runs_now  # True: no lane thread takes controls now, carry them out at once
        self._pending: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self.paused: str | None = None  # the pause mode while paused
        self.released: frozenset[str] = frozenset()  # memory given back (``release_memory``)

    @property
    def holds_rollout(self) -> bool:
        """Rollout may not compute now: paused, or its memory given back."""
        return self.paused is not None or bool(self.released)

    def run_pending(self) -> None:
        """Carry out every queued call (the rollout lane, between iterations)."""
        while self._pending:
            action, done = self._pending.popleft()
            _settle(done, action)

    def between_iterations(self, action: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``action`` at rollout's next iteration boundary (a weight swap, a pause); the future has its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self._runs_now():
            _settle(done, action)
        else:
            self._pending.append((action, done))
            self._rollout.wakeup.set()
        return done

    # ---- the calls
    def pause_generation(self, mode: str) -> concurrent.futures.Future:
        """Stop rollout at the next iteration boundary; resolves with the number of rollout requests affected.

        ``abort``: every queued and running rollout request finishes now with finish_reason "abort".
        ``retract``: running requests give back their KV and wait (they continue by recompute, nothing lost).
        ``in_place``: requests keep their KV and simply wait. New requests queue until ``continue_generation``.
        """
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.paused = mode
        return self.between_iterations(lambda: self._pause_now(mode))

    def continue_generation(self) -> None:
        self.paused = None
        self._rollout.wakeup.set()

    def abort(self, request_id: str | None = None) -> None:
        """Abort one rollout request by id, or every one (None); they finish with "abort"."""
        for rid in [request_id] if request_id is not None else self._rollout.all_request_ids():
            self._rollout.cancel(rid)

    def flush_cache(self) -> concurrent.futures.Future:
        """Drop every retained trajectory prefix, on the device and in the host tier (SGLang's /flush_cache: a
        user asked); resolves with the number of device blocks freed."""
        return self.between_iterations(self._flush_now)

    def release_memory(self, tags: tuple[str, ...]) -> concurrent.futures.Future:
        """Give the rollout side's memory back: ``kv_cache`` (the rollout KV pool's storage) and/or ``weights``
        (the policy parameters, moved to host memory). Rollout holds still until ``resume_memory``; its requests keep
        their tokens and continue by recompute. Resolves with the bytes freed on the device per tag."""
        self._check_tags(tags)
        self.released = self.released | set(tags)
        return self.between_iterations(lambda: self._release_now(tuple(tags)))

    def resume_memory(self, tags: tuple[str, ...]) -> concurrent.futures.Future:
        self._check_tags(tags)
        return self.between_iterations(lambda: self._resume_now(tuple(tags)))

    def _check_tags(self, tags: tuple[str, ...]) -> None:
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise InvalidRequest(f"unknown memory tags {bad}: use {', '.join(MEMORY_TAGS)}", "tags")
        if "weights" in tags and self._offload is None:
            raise InvalidRequest(
                "the policy's weights cannot be released here: it is a LoRA adapter over the serving model's weights, "
                "which serving keeps using (co-batched mode); release kv_cache alone",
                "tags",
            )

    # ---- carried out between iterations
    def _pause_now(self, mode: str) -> int:
        rt = self._rollout
        rt.receive()
        affected = len(rt.waiting) + len(rt.running)
        if mode == "abort":
            self.abort()
            rt.receive()
        elif mode == "retract":
            rt.preempt_all()
        return affected

    def _flush_now(self) -> int:
        prefixes = self._rollout.prefixes
        return prefixes.flush() if prefixes is not None else 0

    def _release_now(self, tags: tuple[str, ...]) -> dict[str, int]:
        rt = self._rollout
        freed = {}
        if "kv_cache" in tags and not rt.pool.released:
            rt.receive()
            rt.preempt_all()
            rt.drop_waiting_kv()  # a waiting turn may hold its retained prefix
            if rt.prefixes is not None:
                rt.prefixes.drop_device()  # the host tier keeps its copies: turns after the resume restore from them
            freed["kv_cache"] = rt.pool.release()
        if "weights" in tags and self._offload is not None:
            freed["weights"] = self._offload()
        return freed

    def _resume_now(self, tags: tuple[str, ...]) -> dict[str, int]:
        restored = {}
        if "kv_cache" in tags:
            restored["kv_cache"] = self._rollout.pool.restore()
        if "weights" in tags and self._reload is not None:
            restored["weights"] = self._reload()
        self.released = self.released - set(tags)
        self._rollout.wakeup.set()
        return restored


def _settle(done: concurrent.futures.Future, action: Callable[[], object]) -> None:
    try:
        done.set_result(action())
    except Exception as exc:  # handed to the caller, never raised on the lane
        done.set_exception(exc)
