"""The executor: one device co-serving a serving model and an RL policy under a rollout lease.

How a generation flows through the home engine (engine.py), and who owns each structure:

    GenerationRequest  ->  Sequence  ->  ForwardItem  ->  (forward, sample)  ->  RequestHandle
    protocol.py            sequence.py   forward_item.py                         outputs.py

- ``GenerationRequest`` (frozen): built by a caller on its asyncio loop (the bus handlers in
  rollout_api.py, the HTTP APIs in http_api.py / sglang_api.py) from its wire type; never changed.
- ``Sequence``: made by ``Engine.submit`` on the caller's loop and appended to its work class's
  ``inbox``; from then on owned by that class's lane thread ("rose-serving" or "rose-rollout",
  device.py), which moves it inbox -> waiting -> running, holds its KV blocks, tokens and sampler
  state, and frees it. Nothing else changes it: ``abort_rollout`` only reads request ids (and queues
  them in ``aborts``), and ``stop()`` finishes what is left after joining the lane threads.
- ``ForwardItem`` (frozen): one running sequence's slice of a batch, built by the lane thread for
  one forward and dropped after it. The runner runs it on that thread (``PagedModelRunner``), on
  the emulated device's clock (``EmulatedRunner``, emulated.py), or, for rollout on CPU, in the
  child process (``ProcessRunner``, rollout_process.py: the items cross a pipe, the KV is shared).
- ``RequestHandle``: returned by ``submit`` to the caller and owned by the caller's loop. The lane
  thread never touches its queue or future: it hands each delta and the final ``GenerationResult``
  to that loop with ``call_soon_threadsafe`` (engine.py ``_deliver``). ``cancel()`` only appends
  the id to the class's ``aborts`` and wakes the lane, which finishes the sequence as "abort".

The SGLang backend (sglang_backend.py) keeps the same ends: ``GenerationRequest`` in,
``RequestHandle`` out, but a ``Job`` (sglang_requests.py: its request, handle and HTTP stream) in place of
``Sequence``, owned by the event loop that called ``start()``; SGLang's servers own the batches.

The lease, as the engine holds it (``EngineLease``, protocol.py), is written on the caller's loop
(``set_rollout_lease``, from leases.py's ``LeaseGuard``) and read by the rollout lane between quanta;
the bus's ``contracts.lease.Lease`` never reaches the engine.
"""
