"""The transformers reference check: Hugging Face's `kernels` beside ours is named, not left to an ImportError."""

from __future__ import annotations

import importlib.metadata
import types

import pytest

from engine.bench import hf_reference


def test_no_hub_distribution_is_no_conflict(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(hf_reference.importlib.metadata, "version", missing)
    assert hf_reference.kernels_conflict() is None


def test_this_environment_loads_the_reference():
    assert hf_reference.require_transformers().AutoModelForCausalLM is not None


def test_hub_distribution_shadowed_by_ours_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(hf_reference.importlib.metadata, "version", lambda name: "0.19.1")
    message = hf_reference.kernels_conflict()
    assert message is not None and "0.19.1" in message and "transformers>=4.51,<5.25" in message
    with pytest.raises(RuntimeError, match="expertspec's own package"):
        hf_reference.require_transformers()


def test_hub_package_itself_imported_is_no_conflict(monkeypatch):
    monkeypatch.setattr(hf_reference.importlib.metadata, "version", lambda name: "0.19.1")
    monkeypatch.setitem(__import__("sys").modules, "kernels", types.SimpleNamespace(get_kernel=lambda: None))
    assert hf_reference.kernels_conflict() is None
