"""The worker extension every fleet server (and the in-process vllm.LLM) runs: verified, versioned reloads.

vLLM mixes this class into its workers (``--worker-extension-cls megatron_offgrpo.fleet.OffgrpoWorkerExtension``)
and exposes its methods through ``collective_rpc``. Each RPC method is named by, and takes the JSON payload of, one
request class of ``transports.calls`` (but the in-process engine's tensor hand-over), and answers a
``transports.WorkerAnswer`` in its wire form (a JSON dict with ``ok`` and either the result or ``error``): a refresh
is rejected *before* anything is loaded when the manifest's version is not the one asked for, the version does not
increase, a file is truncated or fails its CRC-32, or the tensor set is not exactly the served model's (names and
shapes). vLLM's in-place reload cannot be undone once it starts, so every check runs first; if the reload itself
then fails, the worker marks itself dirty (version -1) and the client takes it out of rotation. A request that names
an adapter (``adapter``: ``lora.sync=adapter``) delivers its tensors the same ways, and the worker swaps them into the
engine's LoRA slot (``_lora_swap``: checked and built first, the previous adapter kept when the swap fails).

This module imports no megatron code (the worker process never needs it).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any, Callable

import torch

from checkpoint_tools import Named, expected_hf_shapes
from megatron_offgrpo.fleet import _cpu_sampler, _delta_apply, _lora_swap, _moe_repack
from megatron_offgrpo.fleet._routing_capture import RoutingAnswer, RoutingCapture
from megatron_offgrpo.transports import DIRTY, WorkerAnswer, adapters, calls, deltas, packing

if "vllm" in sys.modules:  # a vLLM worker importing its extension: before it builds its sampler (not the trainer's
    _cpu_sampler.install()  # import of this room, which must not pull vLLM in)


def _on_the_wire(method: Callable[..., WorkerAnswer]) -> Callable[..., dict[str, Any]]:
    """An RPC method answers ``to_wire()`` of its ``WorkerAnswer``: what vLLM pickles or the server sends as JSON."""

    @functools.wraps(method)
    def rpc(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return method(self, *args, **kwargs).to_wire()

    return rpc


class OffgrpoWorkerExtension:
    """Methods added to each vLLM worker (``self`` is the worker: it has ``model_runner``, ``rank``, ``device``)."""

    # ----- state -----------------------------------------------------------------------------------------------
    def _offgrpo_version(self) -> int:
        if getattr(self, "_offgrpo_current", None) is None:
            from megatron_offgrpo.transports import weights_dir

            try:
                found = weights_dir.manifest_version(self.model_runner.model_config.model)
            except Exception:  # a served directory without our manifest: version 0
                found = None
            self._offgrpo_current = 0 if found is None else found
        return self._offgrpo_current

    def _offgrpo_expected(self) -> dict[str, tuple[int, ...]]:
        if getattr(self, "_offgrpo_shapes", None) is None:
            self._offgrpo_shapes = expected_hf_shapes(self.model_runner.model_config.hf_config.to_dict())
        return self._offgrpo_shapes

    def _offgrpo_check_version(self, version: int) -> str | None:
        current = self._offgrpo_version()
        if current == DIRTY:
            return None  # a dirty worker accepts any version: a full refresh repairs it
        if version <= current:
            return f"version {version} is not newer than the served version {current}: versions must increase"
        return None

    def _offgrpo_refusal(self, version: int) -> WorkerAnswer | None:
        """The answer refusing a load of ``version`` before anything is read, or None when it may go ahead."""
        problem = self._offgrpo_check_version(version)
        return WorkerAnswer.failed(problem, version=self._offgrpo_version()) if problem else None

    # ----- RPC methods -----------------------------------------------------------------------------------------
    @_on_the_wire
    def offgrpo_info(self, payload: str = "{}") -> WorkerAnswer:
        """The version, rank, pid, dtype, tensor count and token sampler of this worker."""
        return WorkerAnswer(
            ok=True,
            version=self._offgrpo_version(),
            rank=int(getattr(self, "rank", 0)),
            pid=os.getpid(),
            dtype=str(self.model_runner.model_config.dtype).removeprefix("torch."),
            tensors=len(self._offgrpo_expected()),
            sampler=_cpu_sampler.sampler_name(self.model_runner),
        )

    @_on_the_wire
    def offgrpo_routing_begin(self, payload: str = "{}") -> WorkerAnswer:
        """Record the experts every request is routed to from now on (earlier records dropped): router replay.

        A server started with ``--enable-return-routed-experts`` (a GPU fleet's ``--record-routing``) returns them
        in each answer itself: nothing to record here (``routing_source`` "vllm"). Otherwise the hooks record them
        ("hooks"), refused when they could not record them whole: prefix caching on (a cached prompt is computed by
        another request), compiled/graph execution (Python hooks do not run there), or pipeline stages (each worker
        would hold some of the layers' routing).
        """
        if self.vllm_config.aux_output_config.enable_return_routed_experts:
            return WorkerAnswer(ok=True, version=self._offgrpo_version(), routing_source="vllm")
        runner = self.model_runner
        if runner.cache_config.enable_prefix_caching:
            return WorkerAnswer.failed("router replay: this server caches prompt prefixes, so it cannot record "
                                       "each request's routing; start the fleet with --record-routing")
        if not runner.model_config.enforce_eager:
            return WorkerAnswer.failed("router replay: this server runs compiled graphs, where the routing hooks "
                                       "do not run; start it with --enforce-eager")
        if runner.parallel_config.pipeline_parallel_size > 1:  # the client reads one worker's answer: all layers
            return WorkerAnswer.failed("router replay: a pipeline-parallel server splits the routers over workers; "
                                       "serve the MoE model with tensor (and expert) parallelism")
        try:
            if getattr(self, "_offgrpo_routing", None) is None:
                self._offgrpo_routing = RoutingCapture(runner)
        except ValueError as exc:
            return WorkerAnswer.failed(str(exc))
        self._offgrpo_routing.begin()
        return WorkerAnswer(ok=True, version=self._offgrpo_version(), routing_source="hooks")

    def offgrpo_routing_take(self, payload: str) -> dict[str, Any]:
        """The recorded routing of the sequences of ``calls.RoutingTake`` (``RoutingAnswer`` on the wire)."""
        capture = getattr(self, "_offgrpo_routing", None)
        if capture is None:
            return RoutingAnswer(False, f"router replay: {calls.RoutingBegin.METHOD} was never called").to_wire()
        return capture.take(list(calls.RoutingTake.from_payload(payload).keys)).to_wire()

    @_on_the_wire
    def offgrpo_load_dir(self, payload: str) -> WorkerAnswer:
        """Install the version directory ``{"path", "version"}`` after checking manifest, CRCs, names and shapes."""
        from megatron_offgrpo.transports import weights_dir

        request = calls.LoadDir.from_payload(payload)
        version = int(request.version)
        refused = self._offgrpo_refusal(version)
        if refused:
            return refused
        start = time.perf_counter()
        try:
            tensors = weights_dir.read_version_dir(request.path, version)
        except Exception as exc:
            return WorkerAnswer.failed(f"{type(exc).__name__}: {exc}", version=self._offgrpo_version())
        return self._offgrpo_install(tensors, version, {"read": time.perf_counter() - start}, request.adapter,
                                     request.delta)

    @_on_the_wire
    def offgrpo_join_group(self, payload: str) -> WorkerAnswer:
        """Join a broadcast group (``calls.JoinGroup``)."""
        from megatron_offgrpo.transports import gloo

        join = calls.JoinGroup.from_payload(payload)
        rank = int(join.rank_base) + int(getattr(self, "rank", 0))
        try:
            store = gloo.make_store(join.host, int(join.port), int(join.world_size), False, float(join.timeout_s))
            group = gloo.make_group(store, join.key, rank, int(join.world_size), float(join.timeout_s), join.backend)
        except Exception as exc:
            return WorkerAnswer.failed(f"joining refresh group {join.group_id} failed: {type(exc).__name__}: {exc}")
        groups = getattr(self, "_offgrpo_groups", None) or {}
        groups[join.group_id] = (store, group)
        self._offgrpo_groups = groups
        return WorkerAnswer(ok=True, rank=rank)

    @_on_the_wire
    def offgrpo_leave_group(self, payload: str) -> WorkerAnswer:
        """Forget a broadcast group (``calls.LeaveGroup``: its sockets close with it)."""
        group_id = calls.LeaveGroup.from_payload(payload).group_id
        (getattr(self, "_offgrpo_groups", None) or {}).pop(group_id, None)
        return WorkerAnswer(ok=True)

    @_on_the_wire
    def offgrpo_receive(self, payload: str) -> WorkerAnswer:
        """Receive one stream (``calls.Receive``); with ``commit`` (default) check the streams received for this
        version so far and install them, else stage them for a later commit."""
        from megatron_offgrpo.transports import gloo

        request = calls.Receive.from_payload(payload)
        version = int(request.version)
        entry = (getattr(self, "_offgrpo_groups", None) or {}).get(request.group_id)
        if entry is None:
            return WorkerAnswer.failed(f"not a member of refresh group {request.group_id!r}: join it first")
        staged = getattr(self, "_offgrpo_staged", None)
        if staged is None or staged[0] != version:
            staged = self._offgrpo_staged = (version, [])
        start = time.perf_counter()
        buckets, end = 0, {"version": None, "buckets": None}
        device = torch.device("cpu") if getattr(self, "device", None) is None else self.device
        for kind, body in gloo.recv_stream(entry[1], device):  # always drain the whole stream, even when rejecting
            if kind == gloo.BUCKET:
                staged[1].extend(body)
                buckets += 1
            elif kind == gloo.ABORT:
                self._offgrpo_staged = None
                return WorkerAnswer.failed(
                    f"the trainer aborted the stream of version {version}: {body.get('reason')}",
                    version=self._offgrpo_version(),
                )
            else:
                end = body
        recv_s = time.perf_counter() - start
        problem = self._offgrpo_check_version(version)
        if end["version"] is None or int(end["version"]) != version or int(end["buckets"]) != buckets:
            problem = (
                f"stream is for version {end['version']} with {end['buckets']} buckets, expected version {version} "
                f"and received {buckets} buckets"
            )
        if problem:
            self._offgrpo_staged = None
            return WorkerAnswer.failed(problem, version=self._offgrpo_version())
        if not request.commit:
            return WorkerAnswer(
                ok=True, version=self._offgrpo_version(), staged=len(staged[1]), seconds={"recv": recv_s}
            )
        self._offgrpo_staged = None
        return self._offgrpo_install(staged[1], version, {"recv": recv_s}, request.adapter, request.delta)

    @_on_the_wire
    def offgrpo_load_shm(self, payload: str) -> WorkerAnswer:
        """Install the shared-memory buckets of ``calls.LoadShm``: map each file, view the tensors in place, check and
        reload (the mappings are gone when this returns)."""
        from megatron_offgrpo.transports import packing

        request = calls.LoadShm.from_payload(payload)
        version = int(request.version)
        refused = self._offgrpo_refusal(version)
        if refused:
            return refused
        start = time.perf_counter()
        tensors: Named = []
        for bucket in request.buckets:
            path = os.path.join(request.dir, bucket["file"])
            try:
                size = os.stat(path).st_size
                if size < bucket["bytes"]:
                    raise ValueError(f"holds {size} bytes, the trainer wrote {bucket['bytes']}")
                # shared=False: a private read-only mapping of the trainer's pages (no copy; no write permission needed)
                buffer = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
                tensors.extend(packing.unpack_entries(bucket["tensors"], buffer))
            except FileNotFoundError:
                return WorkerAnswer.failed(
                    f"shared-memory bucket {path} not found: the shm transport needs servers on the trainer's host "
                    "that see its directory (use the collective or disk transport across hosts)",
                    version=self._offgrpo_version(),
                )
            except Exception as exc:
                return WorkerAnswer.failed(
                    f"shared-memory bucket {path}: {type(exc).__name__}: {exc}", version=self._offgrpo_version()
                )
        return self._offgrpo_install(tensors, version, {"map": time.perf_counter() - start}, request.adapter,
                                     request.delta)

    @_on_the_wire
    def offgrpo_install_tensors(self, tensors: Named, version: int, adapter: dict[str, Any] | None = None,
                                delta: dict[str, Any] | None = None) -> WorkerAnswer:
        """Check and install ``tensors`` (HF names, or an adapter's PEFT names with ``adapter``, its spec's wire form,
        or delta blobs with ``delta``) as ``version``: what an engine in this process hands over in memory
        (``collective_rpc(calls.INSTALL_TENSORS, args=(tensors, version, adapter, delta))``, no JSON payload)."""
        spec = adapters.spec_of(adapter)
        return self._offgrpo_refusal(version) or self._offgrpo_install(tensors, version, {}, spec,
                                                                       deltas.spec_of(delta))

    # ----- install ---------------------------------------------------------------------------------------------
    def _offgrpo_install(self, tensors: Named, version: int, seconds: dict[str, float],
                         adapter: adapters.AdapterSpec | None = None,
                         delta: deltas.DeltaSpec | None = None) -> WorkerAnswer:
        """Check the complete name/shape set, then reload in place (one call: all-or-dirty); ``seconds``: the
        phases so far (phase -> wall seconds), the load is added. With ``adapter``: swap the adapter instead; with a
        ``delta`` onto a base: patch the served version (``_offgrpo_apply_delta``); a full version in delta mode
        (``delta.base`` None) leaves its image for the deltas that follow."""
        if delta is not None and delta.base is not None:
            return self._offgrpo_apply_delta(tensors, version, seconds, delta)
        self._offgrpo_image, self._offgrpo_image_version = None, None  # any other install: no delta applies after it
        if adapter is not None:
            return self._offgrpo_swap_adapter(tensors, version, seconds, adapter)
        if _lora_swap.lora_manager(self.model_runner) is not None:
            return WorkerAnswer.failed("this engine serves the policy's LoRA adapter (lora.sync=adapter): it takes "
                                       "adapter refreshes, not whole models", version=self._offgrpo_version())
        try:
            packing.check_complete({n: tuple(t.shape) for n, t in tensors}, self._offgrpo_expected())
        except ValueError as exc:
            return WorkerAnswer.failed(str(exc), version=self._offgrpo_version())
        model = self.model_runner.get_model()
        try:
            refusal = _moe_repack.reload_refusal(model)
        except Exception as exc:  # a vLLM whose MoE layers this worker cannot inspect: load nothing
            refusal = f"cannot check the MoE layers before reloading: {type(exc).__name__}: {exc}"
        if refusal:
            return WorkerAnswer.failed(refusal, version=self._offgrpo_version())
        answer = self._offgrpo_reload(tensors, version, seconds, partial=False)
        if answer.ok and delta is not None and delta.dtype == deltas.dtype_name(self.model_runner.model_config.dtype):
            self._offgrpo_image = _delta_apply.keep_image(tensors, self.model_runner.model_config.dtype)
            self._offgrpo_image_version = version
        return answer

    def _offgrpo_reload(self, tensors: Named, version: int, seconds: dict[str, float], partial: bool) -> WorkerAnswer:
        """Reload ``tensors`` in place (``partial``: some modules only, the others keep their weights), re-derive a
        tied output layer, repack CPU MoE experts; a failure midway leaves the worker dirty."""
        model = self.model_runner.get_model()
        start = time.perf_counter()
        tied_pair = self._offgrpo_tied_modules()
        embed_kernel_before = getattr(tied_pair[1], "cpu_linear", None) if tied_pair else None
        try:
            self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        except Exception as exc:
            self._offgrpo_current, self._offgrpo_image = DIRTY, None
            return WorkerAnswer.failed(
                f"reload of version {version} failed midway, weights are undefined: {type(exc).__name__}: {exc}",
                version=DIRTY,
            )
        try:
            tied_refreshed = self._offgrpo_refresh_tied_head(tied_pair, embed_kernel_before)
        except Exception as exc:
            self._offgrpo_current, self._offgrpo_image = DIRTY, None
            return WorkerAnswer.failed(
                f"version {version} loaded, but re-deriving the tied output layer failed: {type(exc).__name__}: {exc}",
                version=DIRTY,
            )
        repack_start = time.perf_counter()
        try:  # vLLM CPU's reload leaves MoE experts unpacked: see fleet._moe_repack
            repacked = _moe_repack.repack_after_reload(model, dict(tensors), partial=partial)
        except Exception as exc:
            self._offgrpo_current, self._offgrpo_image = DIRTY, None
            return WorkerAnswer.failed(
                f"version {version} loaded, but re-packing its MoE experts failed: {type(exc).__name__}: {exc}",
                version=DIRTY,
            )
        moe_layers = len(_moe_repack.cpu_moe_layers(model))
        self._offgrpo_current = version
        end = time.perf_counter()
        return WorkerAnswer(
            ok=True,
            version=version,
            tensors=len(tensors),
            seconds={**seconds, "load": end - start, **({"moe_repack": end - repack_start} if moe_layers else {})},
            tied_head_refreshed=tied_refreshed,
            moe_repacked=repacked if moe_layers else None,
        )

    def _offgrpo_apply_delta(self, blobs: Named, version: int, seconds: dict[str, float],
                             spec: deltas.DeltaSpec) -> WorkerAnswer:
        """Patch this worker's image by ``blobs`` (every check first: ``_delta_apply.patch``) and reload the modules
        that changed; a refusal keeps the served version and says a full sync is needed (``full_sync_needed``)."""
        current = self._offgrpo_version()
        start = time.perf_counter()
        image = getattr(self, "_offgrpo_image", None) or {}
        try:
            changed = _delta_apply.patch(image, getattr(self, "_offgrpo_image_version", None), current, blobs, spec,
                                         self.model_runner.model_config.dtype)
        except deltas.Refused as exc:
            return WorkerAnswer(ok=False, error=f"delta to version {version} refused, version {current} still serves: "
                                f"{exc}", version=current, full_sync_needed=exc.kind)
        seconds = {**seconds, "patch": time.perf_counter() - start}
        reload = _delta_apply.reload_set(image, changed)
        if reload:
            answer = self._offgrpo_reload(reload, version, seconds, partial=True)
        else:  # nothing changed in the served dtype: the same weights, a new version
            self._offgrpo_current = version
            answer = WorkerAnswer(ok=True, version=version, tensors=0, seconds=seconds)
        if answer.ok:
            self._offgrpo_image_version = version
        return answer

    def _offgrpo_swap_adapter(self, tensors: Named, version: int, seconds: dict[str, float],
                              spec: adapters.AdapterSpec) -> WorkerAnswer:
        """Build the adapter of ``tensors`` (every check first) and swap it into the engine's LoRA slot; a failure
        leaves the previous adapter and version serving (``_lora_swap``)."""
        current = self._offgrpo_version()
        try:
            lora = _lora_swap.build(self.model_runner, spec, tensors)
        except Exception as exc:
            return WorkerAnswer.failed(f"adapter of version {version} rejected, version {current} still serves: "
                                       f"{type(exc).__name__}: {exc}", version=current)
        start = time.perf_counter()
        try:
            _lora_swap.activate(self.model_runner, lora)
        except _lora_swap.RolledBack as exc:
            return WorkerAnswer.failed(f"adapter of version {version} failed to activate, version {current} still "
                                       f"serves: {exc}", version=current)
        except Exception as exc:
            self._offgrpo_current = DIRTY
            return WorkerAnswer.failed(f"adapter swap to version {version} failed and the previous adapter could not "
                                       f"be restored: {type(exc).__name__}: {exc}", version=DIRTY)
        self._offgrpo_current = version
        return WorkerAnswer(ok=True, version=version, tensors=len(tensors),
                            seconds={**seconds, "load": time.perf_counter() - start})

    def _offgrpo_tied_modules(self) -> tuple[Any, Any] | None:
        """(output layer, embedding) when the model ties them (one shared weight), else None."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
            return None
        return head, embed

    def _offgrpo_refresh_tied_head(self, tied: tuple[Any, Any] | None, embed_kernel_before: Any) -> bool:
        """Re-derive the output layer's kernel state from the (reloaded) shared embedding of a tied model.

        vLLM 0.32's in-place reload re-processes the layers that received weights; with tied embeddings the LM
        head receives none (it shares the embedding's parameter), so on CPU its prepacked GEMM kernel keeps the
        previous version (measured: probe |delta| 1.4 nats after a refresh). The reload did rebuild the
        embedding's kernel (``cpu_linear``, the same GEMM on the same weight), so the head takes that one instead of
        packing the weight a second time (0.5B shapes: a 544 MB repack saved); when the embedding's kernel was not
        rebuilt, the head's post-load processing repacks it. On GPU there is no ``cpu_linear`` and that processing
        is a no-op.
        """
        if tied is None:
            return False
        head, embed = tied
        kernel = getattr(embed, "cpu_linear", None)
        if kernel is not None and kernel is not embed_kernel_before:
            head.cpu_linear = kernel
            return True
        method = getattr(head, "quant_method", None)
        if method is None or not hasattr(method, "process_weights_after_loading"):
            return False
        method.process_weights_after_loading(head)
        return True
