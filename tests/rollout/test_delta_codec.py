"""The delta codec (transports.deltas): exact round trips, and every blob that must not apply is refused."""

import pytest
import torch

from megatron_offgrpo.transports import deltas


def _step(t: torch.Tensor, frac: float, seed: int = 0) -> torch.Tensor:
    """``t`` with about ``frac`` of its elements moved by a small update (an optimizer step's shape)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(t.shape, generator=g) < frac
    return torch.where(mask, t + 1e-2 * torch.randn(t.shape, generator=g).to(t.dtype), t).to(t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.5, 1.0])
@pytest.mark.parametrize("compression", ["zlib", "none"])
def test_round_trip_is_bit_identical(dtype, frac, compression):
    old = torch.randn(64, 33).to(dtype)
    new = _step(old, frac) if frac < 1 else (old + 1).to(dtype)
    blob, changed = deltas.encode("w", new, old, base=3, compression=compression)
    assert changed == int((new.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                           != old.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)).sum())
    out = deltas.apply("w", blob, old, base=3)
    out = old if out is None else out
    assert torch.equal(out.view(torch.uint8), new.view(torch.uint8))  # bitwise, -0.0 included
    assert out is old or changed  # an empty delta returns the image itself (nothing to reload)


def test_empty_delta_is_small_and_changes_nothing():
    old = torch.randn(1000)
    blob, changed = deltas.encode("w", old.clone(), old, base=1)
    assert changed == 0 and blob.numel() < 64
    assert deltas.apply("w", blob, old, base=1) is None


def test_applying_twice_is_idempotent():
    """Overwrite encoding: a blob applied onto its own result gives the same tensor (xor would undo it)."""
    old = torch.randn(100)
    new = _step(old, 0.1)
    blob, _ = deltas.encode("w", new, old, base=1)
    once = deltas.apply("w", blob, old, base=1)
    assert torch.equal(once, new) and torch.equal(deltas.apply("w", blob, once, base=1), new)


def test_nan_payload_refused_on_both_sides():
    old = torch.randn(10)
    new = old.clone()
    new[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        deltas.encode("w", new, old, base=0)
    nan_blob, _ = deltas.encode("w", old + 1, old, base=0, compression="none")
    raw = bytearray(nan_blob.numpy().tobytes())
    raw[-4:] = torch.tensor([float("nan")]).view(torch.uint8).numpy().tobytes()  # the last value
    with pytest.raises(deltas.Refused, match="NaN"):
        deltas.apply("w", torch.frombuffer(raw, dtype=torch.uint8), old, base=0)


def test_wrong_base_refused():
    old = torch.randn(10)
    blob, _ = deltas.encode("w", old + 1, old, base=4)
    with pytest.raises(deltas.Refused, match="onto version 4, this engine serves version 5"):
        deltas.apply("w", blob, old, base=5)


def test_checksum_mismatch_refused():
    """A flipped byte of a value, or an image that is not the base, fails the checksum; a flipped header or body byte
    is refused as corrupt."""
    old = torch.randn(200)
    new = _step(old, 0.2)
    blob, _ = deltas.encode("w", new, old, base=2, compression="none")
    raw = bytearray(blob.numpy().tobytes())
    raw[-1] ^= 0x01  # a value's low mantissa bit: still finite, wrong tensor
    with pytest.raises(deltas.Refused, match="checksum"):
        deltas.apply("w", torch.frombuffer(raw, dtype=torch.uint8), old, base=2)
    other = old.clone()
    other[0] += 1  # the engine's image is not the trainer's base
    with pytest.raises(deltas.Refused, match="checksum"):
        deltas.apply("w", blob, other, base=2)
    zipped, _ = deltas.encode("w", new, old, base=2)
    raw = bytearray(zipped.numpy().tobytes())
    raw[deltas.HEADER.size + 2] ^= 0xFF
    with pytest.raises(deltas.Refused):
        deltas.apply("w", torch.frombuffer(raw, dtype=torch.uint8), old, base=2)
    with pytest.raises(deltas.Refused, match="not a delta"):
        deltas.apply("w", torch.zeros(8, dtype=torch.uint8), old, base=2)


def test_wrong_size_or_dtype_refused():
    old = torch.randn(10)
    blob, _ = deltas.encode("w", old + 1, old, base=0)
    with pytest.raises(deltas.Refused, match="elements"):
        deltas.apply("w", blob, torch.randn(11), base=0)
    with pytest.raises(deltas.Refused, match="dtype"):
        deltas.apply("w", blob, old.to(torch.bfloat16), base=0)


def test_positions_format_follows_density():
    """Sparse changes: uint16 gaps (2 B each) while every gap fits, else uint32 gaps; dense: a bitmask (numel / 8 B),
    whichever is smallest."""
    old = torch.zeros(200_000)
    sparse = old.clone()
    sparse[::1000] = 1.0  # 200 changes: 400 B of 2-byte gaps < 25,000 B of mask
    wide = old.clone()
    wide[[5, 100_000, 199_999]] = 1.0  # a gap past 65,535: 12 B of 4-byte gaps
    dense = old + 1
    for new, fmt in ((sparse, deltas.GAPS16), (wide, deltas.GAPS), (dense, deltas.BITMASK)):
        blob, _ = deltas.encode("w", new, old, base=0, compression="none")
        assert deltas.read_header(blob)["fmt"] == fmt
        assert torch.equal(deltas.apply("w", blob, old, base=0), new)


def test_crc32_fallback_round_trips():
    old = torch.randn(50)
    new = old + 1
    kind, value = deltas.checksum(new, deltas.CRC32)
    assert kind == deltas.CRC32 and value == deltas.checksum(new.clone(), deltas.CRC32)[1]


def test_refusals_are_typed():
    """Each refusal names its kind (a worker answer's ``full_sync_needed``), counted as a fixed set of reasons."""
    old = torch.randn(10)
    blob, _ = deltas.encode("w", old + 1, old, base=4, compression="none")
    cases = [(blob, old, 5, "base"), (blob, torch.randn(11), 4, "tensors"), (torch.zeros(8, dtype=torch.uint8), old,
                                                                               4, "corrupt")]
    raw = bytearray(blob.numpy().tobytes())
    raw[-1] ^= 0x01
    cases.append((torch.frombuffer(raw, dtype=torch.uint8), old, 4, "checksum"))
    for b, image, base, kind in cases:
        with pytest.raises(deltas.Refused) as err:
            deltas.apply("w", b, image, base)
        assert err.value.kind == kind and deltas.refusal(kind) == f"refused: {kind}"
    assert deltas.refusal(None) == deltas.refusal("something else") == "refused: failed"


def test_sender_counts_typed_full_sync_reasons():
    """DeltaSender: "first", then deltas, "periodic" every full_every, "incomplete" after a refresh not pushed; an
    engine's refusal is counted by its reason."""
    from megatron_offgrpo.train import DeltaSender

    weights = {"a": torch.randn(64), "b": torch.randn(8, 8)}
    sender = DeltaSender(torch.float32, full_every=2, bucket_bytes=1 << 16)
    kinds = []
    for version in range(1, 6):
        weights = {n: _step(t, 0.1) for n, t in weights.items()}
        payload, reason = sender.payload([list(weights.items())], version)
        kinds.append(reason)
        assert (payload.spec.base is None) == (reason is not None)
        sender.pushed(version, full=reason is not None, refused={"s1": "refused: no image"} if version == 2 else {})
    assert kinds == ["first", None, None, "periodic", None]
    sender.payload([list(weights.items())], 6)  # not pushed: the engines may not serve it
    assert sender.payload([list(weights.items())], 7)[1] == "incomplete"
    assert dict(sender.full_syncs) == {"first": 1, "periodic": 1, "refused: no image": 1, "incomplete": 1}


def test_sender_image_never_aliases_the_trainers_tensors():
    """The export may hand the live parameter (a CPU fp32 trainer): the image must not follow its in-place updates,
    or the next delta would miss them (and every engine would refuse it on the checksum)."""
    from megatron_offgrpo.train import DeltaSender

    live = torch.randn(32)
    sender = DeltaSender(torch.float32, full_every=100, bucket_bytes=1 << 16)
    sender.payload([[("w", live)]], 1)
    sender.pushed(1, full=True, refused={})
    image = live.clone()
    live[:4] += 1.0  # the optimizer's in-place step
    payload, reason = sender.payload([[("w", live)]], 2)
    assert reason is None and payload.stats.changed == 4
    assert torch.equal(deltas.apply("w", payload.buckets[0][0][1], image, 1), live)


def test_apply_in_place_patches_without_a_copy_and_undoes():
    """The worker's path: the image itself is patched (no clone of the tensor) and the undo restores it bitwise;
    a blob whose checksum fails leaves the image as it was."""
    old = torch.randn(1000).to(torch.bfloat16)
    new = old.clone()
    new[::7] += 1
    blob, _ = deltas.encode("w", new, old, base=3)
    image = old.clone()
    storage = image.untyped_storage().data_ptr()
    undo = deltas.apply_in_place("w", blob, image, base=3)
    assert torch.equal(image, new) and image.untyped_storage().data_ptr() == storage
    undo()
    assert torch.equal(image.view(torch.int16), old.view(torch.int16))
    spoiled = old.clone()
    spoiled[1] += 1  # another base than the delta's: the patched tensor fails its checksum
    before = spoiled.clone()
    with pytest.raises(deltas.Refused, match="checksum"):
        deltas.apply_in_place("w", blob, spoiled, base=3)
    assert torch.equal(spoiled, before)


def test_a_refused_blob_restores_every_tensor_patched_before_it():
    """``fleet._delta_apply.patch`` is all or nothing: the second tensor's corrupt blob rolls the first back."""
    from megatron_offgrpo.fleet._delta_apply import patch

    image = {"a": torch.randn(64).to(torch.bfloat16), "b": torch.randn(64).to(torch.bfloat16)}
    before = {n: t.clone() for n, t in image.items()}
    blobs = [(n, deltas.encode(n, t + 1, t, base=5)[0]) for n, t in image.items()]
    raw = bytearray(blobs[1][1].numpy().tobytes())
    raw[-1] ^= 0xFF  # a flipped byte in b's values
    blobs[1] = ("b", torch.frombuffer(raw, dtype=torch.uint8))
    with pytest.raises(deltas.Refused):
        patch(image, 5, 5, blobs, deltas.DeltaSpec(5, "bfloat16"), torch.bfloat16)
    assert all(torch.equal(image[n], before[n]) for n in image)
    good = [(n, deltas.encode(n, t + 1, t, base=5)[0]) for n, t in before.items()]
    assert patch(image, 5, 5, good, deltas.DeltaSpec(5, "bfloat16"), torch.bfloat16) == {"a", "b"}
    assert all(torch.equal(image[n], before[n] + 1) for n in image)
