"""Steering vectors in a config: a vector of the wrong length, non-finite values, files of every kind (npy, pt,
safetensors: pickles, objects, wrong shapes and keys, corrupt bytes) and unknown names, each refused naming its key
before any engine starts."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from conftest import base_config
from test_config import HIDDEN, VEC, V, assert_problem, problems, steer_global


def test_vector_length_differs_from_hidden_size():
    assert_problem(steer_global([1.0] * 127), VEC, "vector has shape [127], model hidden size is 128")
    assert_problem(base_config(vectors={"v": [1.0, 2.0]}), "vectors.v", "model hidden size is 128")


def test_vector_length_in_second_term_of_a_list():
    config = base_config(steering={"global": {"base": {"post_block": [
        {"layer": 0, "vector": V}, {"layer": 1, "vector": [1.0] * 5}]}}})
    assert_problem(config, "steering.global.base.post_block[1].vector", "vector has shape [5]")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inline_vector(bad):
    values = list(V)
    values[7] = bad
    assert_problem(steer_global(values), VEC + ".values[7]", "finite number")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_npy_vector(tmp_path, bad):
    values = np.ones(HIDDEN, dtype=np.float32)
    values[3] = bad
    np.save(tmp_path / "v.npy", values)
    assert_problem(steer_global("v.npy"), VEC, "NaN or inf", base=tmp_path)
    assert_problem(base_config(vectors={"w": {"file": "v.npy"}}), "vectors.w", "NaN or inf", base=tmp_path)


def test_missing_vector_file(tmp_path):
    assert_problem(steer_global("nowhere.npy"), VEC + ".file", "vector file not found", base=tmp_path)
    found = problems(steer_global({"file": "sub/nowhere.safetensors", "key": "a"}), base=tmp_path)
    assert found == {VEC + ".file": f"vector file not found: {tmp_path / 'sub' / 'nowhere.safetensors'}"}


def test_object_npy(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert_problem(steer_global("o.npy"), VEC + ".file", "is not a plain numeric .npy", base=tmp_path)


def test_non_numeric_npy(tmp_path):
    np.save(tmp_path / "s.npy", np.array(["a"] * HIDDEN))
    assert_problem(steer_global("s.npy"), VEC, "non-numeric dtype", base=tmp_path)


def test_npy_with_wrong_shape(tmp_path):
    np.save(tmp_path / "m.npy", np.ones((2, HIDDEN), dtype=np.float32))
    assert_problem(steer_global("m.npy"), VEC, "vector has shape [2, 128]", base=tmp_path)


class NotATensor:
    def __init__(self):
        self.payload = 1


def test_pt_with_a_pickled_class_instance(tmp_path):
    torch.save({"a": NotATensor()}, tmp_path / "evil.pt")  # torch.save pickles it; weights_only refuses it
    assert_problem(steer_global("evil.pt"), VEC + ".file", "does not hold plain tensors", base=tmp_path)


def test_pt_written_with_plain_pickle(tmp_path):
    with open(tmp_path / "set.pt", "wb") as f:
        pickle.dump({"a": {1, 2}, "b": NotATensor()}, f)
    assert_problem(steer_global("set.pt"), VEC + ".file", "does not hold plain tensors", base=tmp_path)


CORRUPT_FILES = {
    "junk.pt": b"this is not a checkpoint",
    "empty.pt": b"",
    "zip.pth": b"PK\x03\x04 not really a zip",
    "empty.npy": b"",
    "pickle.npy": b"garbage",
    "short.npy": b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (128,), }",
    "bad.safetensors": b"definitely not a safetensors file",
    "empty.safetensors": b"",
}


@pytest.mark.parametrize("name", sorted(CORRUPT_FILES))
def test_corrupt_vector_file(tmp_path, name):
    """A file that cannot be read is a config error at the vector's file key, whatever the reader raises."""
    (tmp_path / name).write_bytes(CORRUPT_FILES[name])
    found = problems(steer_global(name), base=tmp_path)
    assert list(found) == [VEC + ".file"], found
    assert name in found[VEC + ".file"]


def test_pt_holding_a_non_tensor(tmp_path):
    torch.save([1.0, 2.0], tmp_path / "l.pt")
    assert_problem(steer_global("l.pt"), VEC + ".file", "holds a list, not a tensor", base=tmp_path)
    torch.save({"only": 3}, tmp_path / "d.pt")
    assert_problem(steer_global("d.pt"), VEC + ".file", "holds a int, not a tensor", base=tmp_path)


def test_pt_dict_of_several_tensors_needs_a_key(tmp_path):
    torch.save({"a": torch.ones(HIDDEN), "b": torch.zeros(HIDDEN)}, tmp_path / "two.pt")
    assert_problem(steer_global("two.pt"), VEC + ".key", "say which with 'key'", base=tmp_path)
    assert_problem(steer_global({"file": "two.pt", "key": "c"}), VEC + ".key", "no tensor 'c'", base=tmp_path)


def test_safetensors_with_the_wrong_key(tmp_path):
    save_file({"love": np.ones(HIDDEN, np.float32), "hate": np.zeros(HIDDEN, np.float32)},
              str(tmp_path / "v.safetensors"))
    found = problems(steer_global({"file": "v.safetensors", "key": "joy"}), base=tmp_path)
    assert list(found) == [VEC + ".key"]
    assert "no tensor 'joy'" in found[VEC + ".key"] and "['hate', 'love']" in found[VEC + ".key"]
    assert_problem(steer_global("v.safetensors"), VEC + ".key", "say which with 'key'", base=tmp_path)
    assert_problem(base_config(vectors={"v": {"file": "v.safetensors", "key": "joy"}}), "vectors.v.key",
                   "no tensor 'joy'", base=tmp_path)


def test_unknown_named_vector():
    found = problems(base_config(
        vectors={"hate": V}, steering={"global": {"base": {"post_block": {"layer": 0, "vector": "love"}}}}))
    assert found == {VEC: "no vector named 'love' under 'vectors' (has ['hate'])"}
    assert_problem(steer_global({"name": "love"}), VEC, "no vector named 'love'")


def test_unknown_named_vector_in_request_decode():
    config = base_config(steering={"request": [{"prompts": "all", "decode": {"mlp_out": [
        {"layer": 0, "vector": V}, {"layer": 1, "vector": {"name": "x"}}]}}]})
    assert_problem(config, "steering.request[0].decode.mlp_out[1].vector", "no vector named 'x'")
