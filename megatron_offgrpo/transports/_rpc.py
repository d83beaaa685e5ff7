"""Calling one worker-extension method on many targets at once, and folding per-worker answers per target."""

from __future__ import annotations

import threading
from typing import Any, Callable

from megatron_offgrpo.transports._protocol import WorkerTarget


def summarize(results: list[Any]) -> dict[str, Any]:
    """One target's answer from its workers' answers: ok only if every worker is ok; timings are the max."""
    if not results:
        return {"ok": False, "error": "no worker answered"}
    errors = [
        r.get("error", "no answer") if isinstance(r, dict) else f"unexpected answer {r!r}"
        for r in results
        if not (isinstance(r, dict) and r.get("ok"))
    ]
    merged: dict[str, Any] = {"ok": not errors, "workers": len(results)}
    if errors:
        merged["error"] = "; ".join(sorted(set(errors)))
    for result in results:
        for key, value in result.items() if isinstance(result, dict) else ():
            if key.endswith("_s"):
                merged[key] = max(merged.get(key, 0.0), float(value))
            elif key in ("version", "tensors", "rank") and key not in merged:
                merged[key] = value
    versions = {r.get("version") for r in results if isinstance(r, dict)}
    if len(versions) > 1:
        merged["ok"] = False
        merged["error"] = f"workers disagree on the version: {sorted(versions, key=str)}"
    return merged


def call_targets(
    targets: list[WorkerTarget],
    method: str,
    kwargs_of: Callable[[int, WorkerTarget], dict[str, Any]],
    timeout: float,
    background: Callable[[], Any] | None = None,
) -> tuple[dict[str, dict[str, Any]], Any]:
    """Call ``method`` on every target concurrently (one thread each); optionally run ``background()`` meanwhile.

    Args:
        kwargs_of: (index, target) -> the method's arguments for that target.
        background: runs in the calling thread while the calls are in flight (e.g. the trainer's broadcast);
            its exception is re-raised after every call returned.

    Returns:
        (name -> summarized answer, background's return value).
    """
    answers: dict[str, dict[str, Any]] = {}

    def call(index: int, target: WorkerTarget) -> None:
        try:
            answers[target.name] = summarize(target.rpc(method, kwargs_of(index, target), timeout))
        except Exception as exc:  # a dead server, a timeout, a rejected token
            answers[target.name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

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
        answers.setdefault(target.name, {"ok": False, "error": f"no answer within {timeout + 60.0:.0f} s"})
    if failure is not None:
        raise failure
    return answers, value
