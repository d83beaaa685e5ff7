"""``FleetEngine``: the ``RolloutEngine`` over N vLLM servers (generation, versioned refresh, probes)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any

from megatron_offgrpo.data import Prompt, Sample, SamplingParams
from megatron_offgrpo.fleet import routing
from megatron_offgrpo.rollout._dispatch import HealthWatch, RetryPolicy, ServerPool, run_groups
from megatron_offgrpo.rollout._errors import FleetError, RefreshError, require_newer
from megatron_offgrpo.rollout._fleet_refresh import FleetRefresh
from megatron_offgrpo.rollout._routing import require_routing, with_routing
from megatron_offgrpo.rollout._samples import parse_group, parse_prompt_logprobs
from megatron_offgrpo.rollout._server import ServerClient
from megatron_offgrpo.rollout._types import ProbeResult, RefreshReport
from megatron_offgrpo.transports import Buckets, WeightTransport, adapters, calls, summarize

logger = logging.getLogger(__name__)


class FleetEngine:
    """Generation on a fleet of vLLM servers, with refreshes every v steps through one ``WeightTransport``.

    Each prompt's G samples go to one server in one request, so a group has one server and (unless
    ``partial_rollouts``) one weight version; groups are spread over the least-loaded servers, retried with backoff
    and failed over when a server dies (``RetryPolicy``). A refresh pauses the servers (draining in-flight requests,
    or freezing them with ``partial_rollouts``), installs the version through the transport, resets the prefix
    cache, labels the engine with the version and resumes. Servers that reject a refresh keep their old weights and
    leave the rotation until a later refresh succeeds on them.
    """

    def __init__(
        self,
        servers: list[ServerClient],
        transport: WeightTransport,
        policy: RetryPolicy | None = None,
        revive_every_s: float = 10.0,
        record_routing: bool = False,
        partial_rollouts: bool = False,
    ) -> None:
        """Connect: read every worker's version, label each engine with it, and check the servers agree.

        ``record_routing``: MoE models, router replay: every sample carries the experts each layer routed its tokens
        to (``Sample.routed_experts``), returned by the servers (started with ``--record-routing``): in each answer
        on GPUs, recorded by their workers on CPU.

        ``partial_rollouts``: a refresh comes between two decode steps of the requests in flight instead of after
        them (``rollout.mode=async_partial``): the servers freeze them (``/pause?mode=keep``), install, and drop
        their KV cache, so that each resumes by recomputing its prompt and tokens so far with the new weights: every
        token is sampled by one version's weights alone and carries that version (``Sample.token_versions``).

        Raises:
            ValueError: no servers, two with one name, or ``partial_rollouts`` with ``record_routing`` (a sample's
                routing would change at the refresh). FleetError: no server is reachable, or a server cannot record
                the routing (``record_routing``).
        """
        if partial_rollouts and record_routing:
            raise ValueError("FleetEngine partial_rollouts=True with record_routing=True: a sample's routing would "
                             "change at the refresh and router replay could not reproduce it")
        if not servers:
            raise ValueError(
                "FleetEngine servers=[]: give at least one server (offgrpo fleet start, then FleetEngine.from_state)"
            )
        names = [s.name for s in servers]
        if len(set(names)) != len(names):
            raise ValueError(f"FleetEngine servers: duplicate names {names}: each server needs its own name")
        self.transport = transport
        self.policy = policy or RetryPolicy()
        self.pool = ServerPool(names, self.policy.dead_after)
        # every call to a server is given up once the pool marks it dead (a frozen server holds calls for minutes)
        self.servers = {s.name: dataclasses.replace(s, given_up=functools.partial(self.pool.why_dead, s.name))
                        for s in servers}
        self._refresh_lock = threading.Lock()
        self._revive_every_s, self._last_revive = revive_every_s, time.monotonic()
        self._version = self._connect()
        self.record_routing = record_routing
        self.partial_rollouts = partial_rollouts
        self._routing_sources: dict[str, str] = {}  # server -> "vllm" (in its answers) or "hooks" (its workers')
        if record_routing:  # refused now (a server caching prefixes, a dense model), not at the first generation
            self._begin_routing()
        # Generations from several threads go to the servers at once (each server batches what it is sent), except
        # where a worker's routing hooks record one generation's experts at a time.
        self.concurrent_generate = not record_routing or set(self._routing_sources.values()) == {"vllm"}
        # a frozen server (or one whose node vanished) would hold its requests and a refresh's calls until their
        # read timeout: while either is in flight, failed health checks mark it dead and its calls are given up
        self._health = HealthWatch(self.pool, lambda name, timeout: self.servers[name].check_health(timeout),
                                   self.policy)

    @classmethod
    def from_state(cls, state_file: str | Path, transport: WeightTransport, lora: adapters.AdapterSpec | None = None,
                   **kwargs: Any) -> "FleetEngine":
        """Connect to the fleet recorded by ``offgrpo fleet start`` (its state file and token).

        Raises:
            ValueError: ``lora`` (the adapter refreshes will carry) is not the adapter the fleet was started with; the
                fleet serves a sequence classifier.
        """
        from megatron_offgrpo.fleet import load_state
        from megatron_offgrpo.rollout._server import servers_of

        state = load_state(state_file)
        if state.runner != "generate":  # a classifier's fleet: no text to sample, no weights to refresh
            raise ValueError(f"the fleet at {state_file} serves a sequence classifier (vLLM's {state.runner} runner): "
                             "it generates nothing and takes no weight refresh; give it to reward.fleet")
        started = adapters.spec_of(state.lora)
        if started != lora:
            raise ValueError(f"the fleet at {state_file} serves the LoRA adapter {started}, the run's lora.* settings "
                             f"say {lora} (lora.sync=adapter): start the fleet with the run's adapter settings")
        return cls(servers_of(state), transport, **kwargs)

    # ----- versions --------------------------------------------------------------------------------------------
    def _worker_version(self, server: ServerClient) -> int:
        info = summarize(server.call(calls.Info(), server.control_timeout_s))
        if not info.ok or info.version is None:
            raise FleetError(
                f"server {server.name}: offgrpo_info failed ({info.error}): is it started with the worker extension?"
            )
        return info.version

    def _label(self, server: ServerClient, version: int) -> None:
        if server.version_label() != str(version):
            server.set_version_label(version)

    def _connect(self) -> int:
        versions: dict[str, int] = {}
        for name, server in self.servers.items():
            if not server.health():
                self.pool.dead[name] = "not reachable at connect"
                continue
            versions[name] = self._worker_version(server)
            self._label(server, versions[name])
        if not versions:
            raise FleetError(
                f"no server of {sorted(self.servers)} answers /health: start the fleet (offgrpo fleet start)"
            )
        newest = max(versions.values())
        for name, version in versions.items():
            if version != newest:
                self.pool.bench(name, f"serves version {version}, the fleet serves {newest}")
        if len(set(versions.values())) > 1:
            logger.warning(
                "servers hold different versions %s: serving %d, the others wait for the next refresh", versions, newest
            )
        return newest

    def _revive(self) -> None:
        """Bring dead servers that answer again back (rate-limited; never during a refresh): into rotation if they
        hold the fleet's version, else out of rotation until the next refresh installs it (a server given up in the
        middle of one may hold the previous version, or none). Each is resumed first: a server given up during a
        refresh may have been left paused."""
        if not self.pool.dead or time.monotonic() - self._last_revive < self._revive_every_s:
            return
        if not self._refresh_lock.acquire(blocking=False):
            return
        try:
            self._last_revive = time.monotonic()
            for name in list(self.pool.dead):
                # a plain client: the fleet's gives up every call to a server while it is dead
                server = dataclasses.replace(self.servers[name], given_up=None)
                try:
                    if not server.health(2.0):
                        continue
                    held = self._worker_version(server)
                    server.resume()
                    if held == self._version:
                        server.reset_prefix_cache(in_flight=True)  # the KV of requests given up with the server
                        self._label(server, held)
                        self.pool.restore(name)
                        logger.info("server %s is back at version %d", name, held)
                    else:
                        self.pool.restore(name)
                        self.pool.bench(name, f"back at version {held}, the fleet serves {self._version}")
                        logger.info("server %s is back at version %d: the next refresh brings it to the fleet's",
                                    name, held)
                except Exception as exc:  # still down
                    logger.debug("server %s still down: %s", name, exc)
        finally:
            self._refresh_lock.release()

    def version(self) -> int:
        """The version the serving servers hold."""
        return self._version

    # ----- generation ------------------------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[Sample]:
        """``len(prompts) * n`` samples, grouped by prompt; each group from one server and one version.

        Raises:
            ValueError: n < 1. FleetError: a group failed on every server, or no server serves.
        """
        if n < 1:
            raise ValueError(f"generate n={n}: the group size must be >= 1")
        self._revive()

        if self.record_routing:
            self._begin_routing()

        sent = [0] * len(prompts)  # requests per group: a group resent after a failure took more than one

        def send(name: str, index: int) -> list[Sample]:
            sent[index] += 1  # one thread runs a group's attempts, one after another
            samples = parse_group(self.servers[name].generate(prompts[index], n, params, index), prompts[index],
                                  index, n, name, one_version=not self.partial_rollouts)
            return self._with_routing(name, samples) if self.record_routing else samples

        with self._health.watching():
            groups = run_groups(self.pool, self.policy, len(prompts), send)
        for group, attempts in zip(groups, sent):
            for sample in group:
                sample.attempts = attempts
        return [sample for group in groups for sample in group]

    def _begin_routing(self) -> None:
        """Every serving worker drops the routing it recorded and records from now on (router replay); each says
        where its routing will come from."""
        for name in self.pool.serving():
            server = self.servers[name]
            answer = summarize(server.call(calls.RoutingBegin(), server.control_timeout_s))
            if not answer.ok:
                raise FleetError(f"server {name}: {answer.error}")
            self._routing_sources[name] = answer.routing_source or "hooks"  # a worker from before the field: hooks

    def _with_routing(self, name: str, samples: list[Sample]) -> list[Sample]:
        """``samples`` (one group from server ``name``) with their routing: from the answer, or claimed from the
        server's worker."""
        if self._routing_sources.get(name) == "vllm":
            return require_routing(samples, name)
        server = self.servers[name]

        def take(keys: list[str]) -> routing.RoutingAnswer:
            answers = server.call(calls.RoutingTake(keys=keys), server.control_timeout_s)
            return routing.RoutingAnswer.from_wire(answers[0] if answers else None)

        return with_routing(samples, take, name)

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, ProbeResult]:
        """Every serving server's version and prompt log-probs of ``token_ids`` ([T-1] each).

        A server that does not answer (e.g. it died between the refresh and the probe) leaves the rotation like a
        server that failed the refresh: its weights were never checked, so it serves again only after a later
        refresh (and its probe) succeeds on it. The others are probed and serve on.

        Raises:
            FleetError: no serving server answered the probe.
        """
        out, failures = {}, {}
        for name in self.pool.serving():
            try:
                version, values = parse_prompt_logprobs(self.servers[name].probe(token_ids), token_ids, name)
            except Exception as exc:
                failures[name] = f"{type(exc).__name__}: {exc}"
                continue
            out[name] = ProbeResult(version, values)
        if failures and not out:
            raise FleetError(f"no server answered the probe: {failures}")
        for name, error in failures.items():
            self.pool.bench(name, f"failed the probe: {error}")
            logger.warning(
                "server %s failed the probe (%s): it gets no work until a refresh succeeds on it; training goes on "
                "with %s",
                name,
                error,
                sorted(out),
            )
        return out

    # ----- refresh ---------------------------------------------------------------------------------------------
    def update_weights(self, weights: Buckets | Path | adapters.AdapterPayload, version: int) -> RefreshReport:
        """Install ``version`` on every reachable server (see the class docstring for the sequence).

        Args:
            weights: HF-named buckets (``checkpoint_tools.stream_hf_buckets``) or a ``write_version_dir`` directory;
                on a fleet serving the policy's LoRA adapter, an ``adapters.AdapterPayload`` (the transport carries
                its buckets, each worker swaps the adapter into its slot; the rest of the sequence is the same).
            version: must be greater than ``version()``.

        Raises:
            ValueError: a version that does not increase. RefreshError: naming each server that did not install
                it (they keep their previous weights; with at least one success they leave the rotation).
        """
        with self._refresh_lock, self._health.watching():
            require_newer(version, self._version, "fleet")
            refresh = FleetRefresh(self.servers, self.pool, self.transport, self.partial_rollouts, self._version)
            outcome = refresh.run(weights, version)
            if outcome.report.servers:
                self._version = int(version)
            if outcome.failures:
                raise RefreshError(int(version), outcome.failures, benched=outcome.benched)
            return outcome.report

    def close(self) -> None:
        """Release the transport (the servers belong to the launcher: ``offgrpo fleet stop``)."""
        self.transport.close()
