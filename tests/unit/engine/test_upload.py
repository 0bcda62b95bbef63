"""HostBatch (k3.engine.upload): one transfer per dtype, fields as aligned views with their
shapes and values."""

import pytest
import torch

from k3.engine.upload import HostBatch


def test_fields_keep_values_shapes_and_16_byte_alignment(monkeypatch):
    copies = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: (copies.append(self.dtype), to(self, *a, **k))[1])
    host = HostBatch()
    host.add("ids", [5, 6, 7], torch.long)
    host.add("table", [[1, 2, 3], [4, 5, 6]], torch.int32)
    host.add("pairs", [(0, 1), (0, 2)], torch.long, shape=(2, 2))
    host.add("cu", [0, 3], torch.int32)
    host.add("empty", [], torch.long)
    host.add("temperature", [0.5, 0.0], torch.float32)
    out = host.upload("cpu")
    assert sorted(copies, key=str) == sorted([torch.long, torch.int32, torch.float32], key=str)  # one per dtype
    assert out["ids"].tolist() == [5, 6, 7] and out["ids"].dtype == torch.long
    assert out["table"].tolist() == [[1, 2, 3], [4, 5, 6]] and out["table"].dtype == torch.int32
    assert out["pairs"].tolist() == [[0, 1], [0, 2]] and out["cu"].tolist() == [0, 3]
    assert out["empty"].shape == (0,) and out["temperature"].tolist() == [0.5, 0.0]
    for name in ("ids", "table", "pairs", "cu"):
        assert out[name].is_contiguous() and out[name].data_ptr() % 16 == 0, name


def test_a_shape_that_does_not_match_is_an_error():
    with pytest.raises(ValueError, match="3 values for shape"):
        HostBatch().add("x", [1, 2, 3], torch.long, shape=(2, 2))
