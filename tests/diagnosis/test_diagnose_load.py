"""flashwatch/diagnosis/load.py: every data format gives the same tokens."""

from __future__ import annotations

import numpy as np
import torch
from _helpers import tiny_gpt

from flashwatch.diagnosis.load import load_tokens, make_batches


def test_data_formats_give_the_same_tokens(tmp_path):
    ids = np.arange(300, dtype=np.uint16) % 50
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.int64))
    torch.save(torch.from_numpy(ids.astype(np.int64)), tmp_path / "t.pt")
    want = torch.from_numpy(ids.astype(np.int64))
    for name in ("t.bin", "t.npy", "t.pt"):
        got = load_tokens(tmp_path / name)
        if not isinstance(got, torch.Tensor):  # .bin, .npy: memory-mapped arrays
            got = torch.from_numpy(np.array(got, dtype=np.int64))
        assert torch.equal(got, want)
        assert torch.equal(make_batches(got, 2, 3, 16, seed=5)[1],
                           make_batches(want, 2, 3, 16, seed=5)[1])
    (tmp_path / "t.txt").write_text("héllo")
    model = tiny_gpt(vocab_size=256)
    assert load_tokens(tmp_path / "t.txt", None, model).tolist() == list("héllo".encode())
    batches = make_batches(want, 3, 2, 16, seed=0)
    assert [tuple(b.shape) for b in batches] == [(2, 17)] * 3
    for b in batches:  # windows of the stream: consecutive ids (mod 50)
        assert torch.equal((b[:, 1:] - b[:, :-1]) % 50, torch.ones(2, 16, dtype=torch.long))
    assert all(torch.equal(a, b) for a, b in zip(batches, make_batches(want, 3, 2, 16, 0),
                                                 strict=True))
