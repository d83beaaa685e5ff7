"""Turning one prompt's G completions from a server's answer into ``Sample``s tagged with the version that made them.

Wire format: vLLM's token-in/token-out endpoint ``POST /inference/v1/generate`` (``--enable-scale-out``). Each
choice carries its token ids, the sampled tokens' log-probs and ``weight_versions``: spans of output positions
with the engine's weight-version label at the step each token was produced. A sample's version is read from
those spans, never from what the client asked for; a choice whose spans hold two versions (a refresh that did not
drain) is refused and the group is generated again. The log-probs are what the server's ``--logprobs-mode`` says
(the launcher sets ``processed_logprobs``: log-softmax(logits / temperature), the distribution sampled from).
A server started with ``--enable-return-routed-experts`` adds each choice's ``routed_experts`` (router replay).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any, TypeVar

import numpy as np
import torch

from megatron_offgrpo.data import Prompt, Sample, SamplingParams

T = TypeVar("T")


class BadResponse(ValueError):
    """An answer that cannot become samples (missing fields, mixed or unlabelled versions): resend the group."""


def completions_to_ask(params: SamplingParams, n: int) -> int:
    """How many completions an engine generates for a group of ``n``: 1 when greedy (temperature 0: the ``n``
    would be identical), else ``n``; ``fill_group`` then makes the group whole."""
    return 1 if params.temperature == 0 else n


def fill_group(group: list[T], n: int) -> list[T]:
    """A group of ``n`` from what the engine returned: a single (greedy) completion stands for the whole group,
    repeated ``n`` times; any other group is returned as is (its size is the caller's to check)."""
    return group * n if len(group) == 1 and n > 1 else group


def sampling_body(params: SamplingParams, n: int, group_id: int) -> dict[str, Any]:
    """vLLM sampling params for one group. Greedy groups are asked once (``completions_to_ask``) and made whole by
    the parser (``fill_group``).

    A per-request seed becomes ``seed + group_id``: groups differ, and a resent group samples the same tokens.
    """
    body: dict[str, Any] = {
        "n": completions_to_ask(params, n),
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": max(params.top_k, 0),
        "logprobs": 0,
        "detokenize": False,
        # SamplingParams has no penalties: send the neutral values so the server does not apply the model's
        # generation_config defaults (Qwen's repetition_penalty=1.1) to keys the request leaves out.
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_p": 0.0,
    }
    if params.seed is not None:
        body["seed"] = params.seed + group_id
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def parse_version(spans: list[dict[str, Any]] | None, where: str) -> int:
    """The single integer weight version of a choice's ``weight_versions`` spans.

    Raises:
        BadResponse: no spans, several versions, or a label that is not an integer (a server never told its version).
    """
    labels = {str(span["version"]) for span in spans or []}
    if len(labels) != 1:
        raise BadResponse(
            f"{where}: weight versions {sorted(labels) or 'missing'}: a sample must come from exactly one version"
        )
    label = labels.pop()
    try:
        return int(label)
    except ValueError:
        raise BadResponse(
            f"{where}: weight version label {label!r} is not an integer (the server was never given its version)"
        ) from None


def parse_token_versions(spans: list[dict[str, Any]], tokens: int, where: str) -> tuple[int, list[int] | None]:
    """A completion's version and, when a refresh came while it was generated (``rollout.mode=async_partial``),
    the version of each of its ``tokens`` tokens: (the oldest version, per-token versions or None for one version).

    Raises:
        BadResponse: spans that do not tile ``[0, tokens)`` in order, or a label that is not an integer.
    """
    if len({str(span["version"]) for span in spans}) <= 1:
        return parse_version(spans, where), None
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions) or span["end"] < span["start"]:
            raise BadResponse(f"{where}: weight version spans {spans} do not tile the {tokens} tokens in order")
        versions += [parse_version([span], where)] * (span["end"] - span["start"])
    if len(versions) != tokens:
        raise BadResponse(f"{where}: weight version spans cover {len(versions)} of {tokens} tokens")
    return min(versions), versions


def routing_tensor(routing: np.ndarray | None) -> torch.Tensor | None:
    """vLLM's routed experts (uint8, uint16 or int32 by the expert count) as the int16 tensor every engine gives."""
    return None if routing is None else torch.from_numpy(np.asarray(routing).astype(np.int16))


def parse_routed_experts(encoded: str, positions: int, where: str) -> torch.Tensor:
    """A choice's ``routed_experts`` (a server started with ``--enable-return-routed-experts``: base64 of a ``.npy``
    array ``[positions, layers, top_k]``, the prompt and every sampled token but the last) as an int16 tensor.

    Raises:
        BadResponse: not such an array, or one whose positions are not the sample's.
    """
    try:
        routing = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise BadResponse(f"{where}: routed_experts is not a base64 .npy array ({exc})") from None
    if routing.ndim != 3 or routing.dtype.kind not in "iu" or routing.shape[0] != positions:
        raise BadResponse(f"{where}: routed_experts of shape {list(routing.shape)} ({routing.dtype}) for "
                          f"{positions} input positions: expected [positions, layers, top_k] integers")
    return routing_tensor(routing)


def parse_group(answer: dict[str, Any], prompt: Prompt, group_id: int, n: int, server: str,
                one_version: bool = True) -> list[Sample]:
    """The ``n`` samples of one group from one ``/inference/v1/generate`` answer. ``one_version``: every token of
    the group must come from one version (False with partial rollouts: each token then carries its own).

    Raises:
        BadResponse: wrong number of choices, missing token ids or log-probs, unlabelled versions, or mixed ones
            where ``one_version``.
    """
    choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
    where = f"server {server}, prompt {prompt.prompt_id} (group {group_id})"
    choices = fill_group(choices, n)
    if len(choices) != n:
        raise BadResponse(f"{where}: {len(choices)} choices for a group of {n}")
    samples = []
    for choice in choices:
        ids = choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        if ids is None or content is None or len(content) != len(ids):
            raise BadResponse(f"{where}: answer lacks token ids or one log-prob per token")
        finish = choice.get("finish_reason") or ""
        if finish not in ("stop", "length"):
            raise BadResponse(f"{where}: finish_reason {finish!r} (aborted or failed)")
        routing = choice.get("routed_experts")
        if routing is not None:
            routing = parse_routed_experts(routing, len(prompt.prompt_ids) + len(ids) - 1, where)
        if one_version:
            version, token_versions = parse_version(choice.get("weight_versions"), where), None
        else:
            version, token_versions = parse_token_versions(choice.get("weight_versions") or [], len(ids), where)
        samples.append(
            Sample(
                prompt_id=prompt.prompt_id,
                group_id=group_id,
                prompt_ids=list(prompt.prompt_ids),
                response_ids=list(ids),
                behavior_logprobs=[float(c["logprob"]) for c in content],
                policy_version=version,
                finish_reason=finish,
                server=server,
                routed_experts=routing,
                token_versions=token_versions,
            )
        )
    if one_version and len({s.policy_version for s in samples}) != 1:
        raise BadResponse(f"{where}: the group's samples come from several versions")
    return samples


def parse_prompt_logprobs(answer: dict[str, Any], token_ids: list[int], server: str) -> tuple[int, list[float]]:
    """(version, [T-1] log p(token_ids[t] | token_ids[:t])) from a probe answer (``prompt_logprobs=0``)."""
    values = prompt_logprob_values(answer, token_ids, server)
    choice = (answer.get("choices") or [{}])[0]
    return parse_version(choice.get("weight_versions"), f"server {server}, probe"), values


def prompt_logprob_values(answer: dict[str, Any], token_ids: list[int], server: str) -> list[float]:
    """[T-1] log p(token_ids[t] | token_ids[:t]) from a probe answer (``prompt_logprobs=0``), whatever the server's
    version label (a distillation teacher's fleet is never refreshed, nor labelled)."""
    entries = answer.get("prompt_logprobs")
    if not entries or len(entries) != len(token_ids):
        raise BadResponse(f"server {server}: probe answer has no prompt log-probs for {len(token_ids)} tokens")
    values = []
    for t in range(1, len(token_ids)):
        entry = entries[t] or {}
        item = entry.get(str(token_ids[t]), entry.get(token_ids[t]))
        if item is None:
            raise BadResponse(f"server {server}: probe position {t} lacks the log-prob of token {token_ids[t]}")
        values.append(float(item["logprob"]))
    return values
