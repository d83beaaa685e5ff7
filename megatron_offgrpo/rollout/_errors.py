"""Errors of the rollout room: each names the servers, the version and what to do about it."""

from __future__ import annotations


def require_newer(version: int, served: int, holder: str = "engine") -> None:
    """The check every ``update_weights`` makes first: a refresh must install a newer version than ``served``.

    Raises:
        ValueError: naming both versions.
    """
    if int(version) <= served:
        raise ValueError(
            f"update_weights version={version}: the {holder} already serves version {served}; versions must increase"
        )


class FleetError(RuntimeError):
    """The fleet cannot serve a request: every server is dead, or a group failed on all attempts."""


class RefreshError(RuntimeError):
    """A weight refresh was rejected or failed on the servers named.

    When no server installed the version, all keep their previous weights and the engine's version is unchanged;
    when some did, the failed ones leave the rotation (they get no work) until a later refresh succeeds on them.

    Attributes:
        version: the version that was being installed.
        failures: server name -> reason, for every server that did not install it.
    """

    def __init__(self, version: int, failures: dict[str, str], benched: bool = False) -> None:
        self.version = version
        self.failures = dict(failures)
        lines = "\n  ".join(f"{name}: {reason}" for name, reason in sorted(failures.items()))
        after = (
            "they get no work until a later refresh succeeds on them"
            if benched
            else "they keep their previous weights and the engine still serves its previous version"
        )
        super().__init__(
            f"weight refresh to version {version} failed on {len(failures)} server(s); {after}:\n  {lines}"
        )


class RefreshVerificationError(RuntimeError):
    """After a refresh, the fleet's log-probs of the probe sequence differ from the trainer's: stop the run.

    Attributes:
        version: the version that was verified. servers: server name -> max |delta log-prob| for each failing server.
        atol: the tolerance that was exceeded.
    """

    def __init__(self, version: int, servers: dict[str, float], atol: float, detail: str = "") -> None:
        self.version = version
        self.servers = dict(servers)
        self.atol = atol
        worst = ", ".join(f"{name} (max |delta| {err:.3g})" for name, err in sorted(servers.items()))
        super().__init__(
            f"refresh verification failed for weight version {version}: the probe log-probs of {worst} differ "
            f"from the trainer's by more than atol={atol:g}. The servers hold wrong or stale weights (a transposed, "
            f"missing or mis-resharded tensor, or a refresh that did not happen); stop the run and check the export "
            f"(checkpoint_tools mapping, PP/TP reshard) of version {version}.{(' ' + detail) if detail else ''}"
        )


class EngineDiedError(RuntimeError):
    """A process of the engine (vLLM's engine core, run in a process of its own under torchrun) died while the
    trainer waited on it: vLLM would wait for its answer forever. The message is the one line every rank prints.

    Attributes:
        pid: the dead process. reason: how it ended ("killed by SIGKILL", "exit code 1").
    """

    def __init__(self, pid: int, reason: str) -> None:
        self.pid, self.reason = pid, reason
        super().__init__(f"the vLLM engine process (pid {pid}) died: {reason}; the run stops here (--resume continues "
                         "from its last checkpoint)")

    def __reduce__(self):  # pickled whole: rank 0 broadcasts it, and every rank raises the same error
        return type(self), (self.pid, self.reason)


class UnservableModelError(ValueError):
    """vLLM on this machine cannot serve the model (a head size its CPU attention has no kernel for), known before
    its engine starts: ``rollout.engine=auto`` falls back to the transformers engine, an explicit ``vllm`` is refused
    in one line (on CPU vLLM would start, then end the first generation in a traceback)."""
