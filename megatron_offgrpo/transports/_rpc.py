"""Calling one worker-extension method on many targets at once, and folding per-worker answers per target."""

from __future__ import annotations

import threading
from typing import Any, Callable

from megatron_offgrpo.transports._answers import WorkerAnswer
from megatron_offgrpo.transports._protocol import WorkerTarget
from megatron_offgrpo.transports._worker_calls import WorkerRequest


def summarize(results: list[Any]) -> WorkerAnswer:
    """One target's answer from its workers' wire answers: ok only if every worker is ok and all name one version;
    the slowest worker's seconds per phase; version, tensors, rank, sampler, moe_repacked, routing_source and
    full_sync_needed from the first worker that gives them."""
    if not results:
        return WorkerAnswer(ok=False, error="no worker answered", workers=0)
    answers = [WorkerAnswer.from_wire(r) for r in results]
    errors = sorted({a.error or "no answer" for a in answers if not a.ok})
    seconds: dict[str, float] = {}
    for answer in answers:
        for phase, value in answer.seconds.items():
            seconds[phase] = max(seconds.get(phase, 0.0), value)
    error = "; ".join(errors) if errors else None
    # only the answers that were dicts vote: one that was not is reported as unexpected, not as a version of None
    versions = {a.version for a, r in zip(answers, results) if isinstance(r, dict)}
    if len(versions) > 1:
        error = f"workers disagree on the version: {sorted(versions, key=str)}"
    return WorkerAnswer(
        ok=error is None,
        error=error,
        version=next((a.version for a in answers if a.version is not None), None),
        tensors=next((a.tensors for a in answers if a.tensors is not None), None),
        rank=next((a.rank for a in answers if a.rank is not None), None),
        sampler=next((a.sampler for a in answers if a.sampler is not None), None),
        moe_repacked=next((a.moe_repacked for a in answers if a.moe_repacked is not None), None),
        routing_source=next((a.routing_source for a in answers if a.routing_source is not None), None),
        full_sync_needed=next((a.full_sync_needed for a in answers if a.full_sync_needed is not None), None),
        workers=len(results),
        seconds=seconds,
    )


def call_targets(
    targets: list[WorkerTarget],
    request_of: Callable[[int, WorkerTarget], WorkerRequest],
    timeout: float,
    background: Callable[[], Any] | None = None,
) -> tuple[dict[str, WorkerAnswer], Any]:
    """Send each target its request concurrently (one thread each); optionally run ``background()`` meanwhile.

    Args:
        request_of: (index, target) -> the request for that target.
        background: runs in the calling thread while the calls are in flight (e.g. the trainer's broadcast);
            its exception is re-raised after every call returned.

    Returns:
        (name -> summarized answer, background's return value).
    """
    answers: dict[str, WorkerAnswer] = {}

    def call(index: int, target: WorkerTarget) -> None:
        try:
            answers[target.name] = summarize(target.call(request_of(index, target), timeout))
        except Exception as exc:  # a dead server, a timeout, a rejected token
            answers[target.name] = WorkerAnswer.failed(f"{type(exc).__name__}: {exc}")

    threads = [
        threading.Thread(target=call, args=(i, t), daemon=True, name=f"offgrpo-rpc-{t.name}")
        for i, t in enumerate(targets)
    ]
    for thread in threads:
        thread.start()
    value, failure = None, None
    try:
        if background is not None:
            value = background()
    except BaseException as exc:
        failure = exc
    for thread in threads:
        thread.join(timeout + 60.0)
    for target in targets:
        answers.setdefault(target.name, WorkerAnswer.failed(f"no answer within {timeout + 60.0:.0f} s"))
    if failure is not None:
        raise failure
    return answers, value
