"""`pagedserve serve` flags -> ServerConfig without a model: repeated --model [NAME=]PATH, names and
aliases, the admin key, the cluster flags and the combinations refused."""

from __future__ import annotations

import argparse
import re

import pytest

from pagedserve.config import ClusterConfig
from pagedserve.entrypoints.cli_args import ADMIN_KEY_ENV, add_serve_arguments, server_config_from_args


def config(*argv: str):
    parser = add_serve_arguments(argparse.ArgumentParser())
    return server_config_from_args(parser.parse_args(list(argv)))


def test_default_model_single_process():
    cfg = config()
    (spec,) = cfg.models
    assert spec.name == "SmolLM2-135M-Instruct" and spec.engine_config.model.model is None
    assert spec.engine == "paged" and spec.replicas == 1
    assert cfg.cluster is None and cfg.admin_key is None
    assert cfg.engine_config is spec.engine_config and cfg.names_of(spec) == ("SmolLM2-135M-Instruct",)


def test_tensor_parallel_size_flag():
    assert config().engine_config.parallel.tensor_parallel_size == 1
    assert config("-tp", "2").engine_config.parallel.tensor_parallel_size == 2
    assert config("--tensor-parallel-size", "3").engine_config.parallel.tensor_parallel_size == 3


def test_kv_admission_flag():
    assert config().engine_config.scheduler.kv_admission == "immediate"
    assert config("--kv-admission", "lookahead").engine_config.scheduler.kv_admission == "lookahead"
    with pytest.raises(SystemExit):
        config("--kv-admission", "eager")


def test_served_model_names_are_aliases_of_the_single_model():
    cfg = config("--model", "/m/Llama-3.2-1B-Instruct-Q4_K_M.gguf", "--served-model-name", "x", "y")
    (spec,) = cfg.models
    assert spec.name == "x" and spec.engine_config.model.served_model_name == "x"
    assert cfg.names_of(spec) == ("x", "y")


def test_several_models_share_the_engine_flags(tmp_path):
    odd = tmp_path / "a=b.gguf"  # an existing path with '=' is a path
    odd.write_bytes(b"GGUF")
    cfg = config(
        "--model", "/m/Qwen2.5-0.5B-Instruct/", "--model", "small=/m/s.gguf", "--model", str(odd),
        "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-num-seqs", "8",
    )  # fmt: skip
    assert [spec.name for spec in cfg.models] == ["Qwen2.5-0.5B-Instruct", "small", "a=b"]
    assert [spec.engine_config.model.model for spec in cfg.models] == [
        "/m/Qwen2.5-0.5B-Instruct/",
        "/m/s.gguf",
        str(odd),
    ]
    for spec in cfg.models:
        assert spec.engine_config.model.dtype == "float32"
        assert spec.engine_config.cache.kv_cache_memory == 64 << 20
        assert spec.engine_config.scheduler.max_num_seqs == 8
        assert cfg.names_of(spec) == (spec.name,)
    assert cfg.default_model.name == "Qwen2.5-0.5B-Instruct"
    assert cfg.admission_capacity(cfg.models[1]) == 8 + 1024


def test_admin_key_flag_and_env(monkeypatch):
    assert config("--admin-key", "k").admin_key == "k"
    monkeypatch.setenv(ADMIN_KEY_ENV, "from-env")
    assert config().admin_key == "from-env"
    assert config("--admin-key", "flag").admin_key == "flag"


def test_cluster_flags():
    cfg = config(
        "--model", "a=/m/a.gguf", "--model", "b=/m/b.gguf", "--replicas", "2", "--replicas", "b=3",
        "--cpus-per-replica", "2", "--request-router", "least-loaded", "--ray-object-store-memory", "128MiB",
    )  # fmt: skip
    assert [(spec.name, spec.replicas) for spec in cfg.models] == [("a", 2), ("b", 3)]
    assert cfg.cluster == ClusterConfig(
        cpus_per_replica=2.0, request_router="least-loaded", object_store_memory=128 << 20
    )
    joined = config("--ray-address", "10.0.0.1:6379", "--ray-dashboard")
    assert joined.cluster.ray_address == "10.0.0.1:6379" and joined.cluster.dashboard
    assert joined.models[0].replicas == 1
    assert cfg.admission_capacity(cfg.models[1]) == 256 * 3 + 1024
    # the five engines split the memory share evenly
    assert [spec.engine_config.cache.memory_shared_by for spec in cfg.models] == [5, 5]


def test_kv_cache_sizing_flags():
    cache = config().models[0].engine_config.cache
    assert cache.kv_cache_memory is None and cache.memory_utilization is None and cache.memory_shared_by == 1
    assert config("--memory-utilization", "0.3").models[0].engine_config.cache.memory_utilization == 0.3
    assert config("--gpu-memory-utilization", "0.8").models[0].engine_config.cache.memory_utilization == 0.8  # vLLM's
    two = config("--model", "a=/m/a.gguf", "--model", "b=/m/b.gguf", "--kv-cache-memory", "2GiB")
    assert [(s.engine_config.cache.kv_cache_memory, s.engine_config.cache.memory_shared_by) for s in two.models] == [
        (2 << 30, 2),
        (2 << 30, 2),
    ]


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "half", "nan"])
def test_memory_utilization_must_be_a_fraction(value, capsys):
    from pagedserve.cli import main

    with pytest.raises(SystemExit) as excinfo:
        main(["serve", "--memory-utilization", value])
    assert excinfo.value.code == 2
    assert "expected a fraction > 0 and <= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "a=/x.gguf", "--model", "a=/y.gguf"], "one name"),
        (["--model", "/d/x.gguf", "--model", "/e/x.gguf"], "one name"),
        (["--model", "a=/x.gguf", "--model", "/y.gguf", "--served-model-name", "n"], "--served-model-name"),
        (["--model", "a=/x.gguf", "--served-model-name", "n"], "not both"),
        (["--model", "=/x.gguf"], "NAME=PATH"),
        (["--model", "a=/x.gguf", "--model", "b=/y.gguf", "--tokenizer", "/t"], "--tokenizer"),
        (["--replicas", "0"], "at least 1"),
        (["--replicas", "two"], "N or NAME=N"),
        (["--replicas", "zz=2"], "no model is served as 'zz'"),
        (["--cpus-per-replica", "2"], "--replicas N or --ray-address"),
        (["--ray-dashboard"], "--replicas N or --ray-address"),
        (["--replicas", "2", "--engine-core", "thread"], "cannot have replicas"),
        (["--replicas", "2", "--tensor-parallel-size", "2"], "cannot be combined with replicas"),
        (["-tp", "0"], "tensor_parallel_size must be a positive integer"),
        (["-tp", "2", "--engine", "hf"], "tensor parallelism needs the paged engine"),
        (["-tp", "2", "--speculative-config", '{"model": "/d"}'], "'draft_model' does not run with tensor_parallel"),
    ],
)
def test_bad_combinations(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config(*argv)


def test_argparse_reports_the_error(capsys):
    from pagedserve.cli import main

    with pytest.raises(SystemExit) as excinfo:
        main(["serve", "--cpus-per-replica", "2"])
    assert excinfo.value.code == 2
    assert "--replicas N or --ray-address" in capsys.readouterr().err
