"""Every config in conf/ composes and validates; bad input fails with a message naming the option."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf.errors import ConfigKeyError, ValidationError

from moc_lightning.config import CheckpointConfig
from moc_lightning.jobs import training
from moc_lightning.jobs.training import TrainConfig, register_configs, to_train_config
from moc_lightning.tools.bench import register_configs as register_bench_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
# Options that a group's config leaves for the user to fill (``???``).
REQUIRED = {"data/text": ["data.paths=[a.txt]"], "data/bin": ["data.paths=[a.bin]"]}


def _compose(overrides: list[str], hydra_config: bool = False, root: str = "train"):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(root, overrides=overrides, return_hydra_config=hydra_config)


TRAIN_GROUPS = ("model", "data", "trainer", "checkpoint", "hydra/launcher")
BENCH_GROUPS = ("preset",)


HF_MODELS = sorted(path.stem for path in (CONF / "model").glob("hf_*.yaml"))
"""Hugging Face models: the ``model`` options of ``train_hf.yaml`` (recipes/train_hf.py), not of ``train.yaml``."""


def _group_options(groups: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted(
        (str(path.parent.relative_to(CONF)), path.stem)
        for path in CONF.rglob("*.yaml")
        if str(path.parent.relative_to(CONF)) in groups and path.stem not in HF_MODELS
    )


def test_every_config_file_is_composed_by_some_test() -> None:
    """A new config group must be added to TRAIN_GROUPS or BENCH_GROUPS, or it would never be checked."""
    roots = {path.stem for path in CONF.glob("*.yaml")}
    groups = {str(path.parent.relative_to(CONF)) for path in CONF.rglob("*.yaml") if path.parent != CONF}
    assert roots == {"train", "train_hf", "bench", "memory_report"}  # memory_report: test_memory_report runs it
    assert groups == set(TRAIN_GROUPS) | set(BENCH_GROUPS)


@pytest.mark.parametrize(("group", "option"), _group_options(BENCH_GROUPS))
def test_every_bench_preset_composes(group: str, option: str) -> None:
    register_bench_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("bench", overrides=[f"{group}={option}", "out=/tmp/x.json"])
    assert cfg.steps > 0 and cfg.model.num_experts >= 1


@pytest.mark.parametrize(("group", "option"), _group_options(TRAIN_GROUPS))
def test_every_config_composes(group: str, option: str) -> None:
    overrides = [f"{group}={option}", *REQUIRED.get(f"{group}/{option}", [])]
    if group.startswith("hydra/"):
        cfg = _compose(overrides, hydra_config=True)
        assert cfg.hydra.launcher.tasks_per_node == cfg.trainer.devices
        return
    cfg = _compose(overrides)
    train = to_train_config(cfg)
    assert isinstance(train, TrainConfig)


def test_model_presets_have_paper_shapes() -> None:
    shapes = {
        name: to_train_config(_compose([f"model={name}", "trainer.devices=8"])).model
        for name in ("gpt_125m_8e", "gpt_350m_16e")
    }
    assert (shapes["gpt_125m_8e"].n_layer, shapes["gpt_125m_8e"].n_embd, shapes["gpt_125m_8e"].num_experts) == (
        12,
        768,
        8,
    )
    assert (shapes["gpt_350m_16e"].n_layer, shapes["gpt_350m_16e"].n_embd, shapes["gpt_350m_16e"].num_experts) == (
        24,
        1024,
        16,
    )


def test_unknown_key_is_rejected() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        _compose(["checkpoint.k_snapshott=2"])
    assert "Key 'k_snapshott' not in 'CheckpointConfig'" in str(err.value.__cause__)


def test_appended_unknown_key_is_rejected() -> None:
    """Hydra's ``+key=value`` gets past composition; turning the config into objects must still refuse it."""
    cfg = _compose(["+checkpoint.k_snapshott=2"])
    with pytest.raises(ConfigKeyError, match="Key 'k_snapshott' not in 'CheckpointConfig'"):
        to_train_config(cfg)


def test_wrong_type_is_rejected() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        _compose(["trainer.devices=two"])
    assert isinstance(err.value.__cause__, ValidationError)
    assert "devices" in str(err.value.__cause__)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["checkpoint.k_snapshot=0"], "checkpoint.k_snapshot must be >= 1"),
        (["checkpoint.k_snapshot=9"], "checkpoint.k_snapshot=9 must be <= the number of experts per MoE layer (8)"),
        (["checkpoint.k_snapshot=2", "checkpoint.k_persist=3"], "checkpoint.k_persist=3 must be <= checkpoint.k_snapshot=2"),
        (["checkpoint.selection=random"], "checkpoint.selection='random' is not allowed; choose one of: sequential, load_aware"),
        (["checkpoint.sharding=zero"], "checkpoint.sharding='zero' is not allowed"),
        (["checkpoint.pec_scope=WO"], "checkpoint.pec_scope='WO' is not allowed; choose one of: both, optimizer, weights"),
        (["checkpoint.storage.backend=s3"], "checkpoint.storage.backend='s3' is not allowed"),
        (["checkpoint.storage.endpoint=http://127.0.0.1:9000"], "checkpoint.storage.endpoint='http://127.0.0.1:9000' is for an S3-compatible store: it needs checkpoint.storage.backend=tensorstore and checkpoint.storage.url=s3://BUCKET/path, not backend='filesystem' and url=''"),
        (["checkpoint.storage.backend=tensorstore", "checkpoint.storage.url=s3://b/run", "checkpoint.storage.endpoint=minio:9000"], "checkpoint.storage.endpoint='minio:9000' is not an endpoint; give http(s)://host[:port]"),
        (["checkpoint.storage.backend=tensorstore", "checkpoint.storage.url=s3://b/run", "checkpoint.storage.endpoint=http://minio:9000/s3"], "checkpoint.storage.endpoint='http://minio:9000/s3' is not an endpoint"),
        (["checkpoint.storage.retries.stall_timeout_s=-1"], "checkpoint.storage.retries.stall_timeout_s=-1 is not allowed; give whole seconds >= 0 (0: no bound)"),
        (["checkpoint.every_n_train_steps=0"], "checkpoint.every_n_train_steps must be >= 1"),
        (["trainer.ep=3"], "trainer.ep=3 must divide the number of processes"),
        (["trainer.data_parallel=zero3"], "trainer.data_parallel='zero3' is not supported; choose one of: ddp, zero2, fsdp2, hsdp"),
        (["trainer.data_parallel=hsdp", "trainer.ep=2", "trainer.hsdp_shard_size=1"], "the EP degree 2 (trainer.ep; null means all 2 ranks) must divide trainer.hsdp_shard_size=1"),
        (["trainer.data_parallel=hsdp", "trainer.hsdp_shard_size=3"], "trainer.hsdp_shard_size=3 must be >= 1 and divide the number of processes 2"),
        (["trainer.hsdp_shard_size=1"], "trainer.hsdp_shard_size=1 is for trainer.data_parallel=hsdp, not 'ddp'"),
        (["trainer.data_parallel=fsdp2", "trainer.precision=bf16-true"], "trainer.precision='bf16-true' is not supported with trainer.data_parallel=fsdp2|hsdp"),
        (["trainer.precision=bf16-true"], "trainer.precision='bf16-true' with trainer.data_parallel=ddp would keep bf16/fp16 weights"),
        (["model.n_head=3"], "model.n_embd=64 must be divisible by model.n_head=3"),
        (["data.source=web"], "data.source='web' is not one of stdlib, text, bin"),
        (["checkpoint.mode=sparse"], "checkpoint.mode='sparse' is not allowed; choose one of: pec, replay"),
        (["checkpoint.mode=replay", "checkpoint.replay.window=0"], "checkpoint.replay.window must be >= 1, got 0"),
        (["checkpoint.mode=replay", "checkpoint.replay.window=big"], "checkpoint.replay.window='big' is not allowed; choose an integer >= 1 or auto"),
        (["checkpoint.mode=replay", "trainer.data_parallel=zero2", "trainer.precision=16-mixed"], "checkpoint.mode=replay with trainer.precision='16-mixed' and trainer.data_parallel=zero2"),
        (["checkpoint.mode=replay", "trainer.precision=16-mixed"], "checkpoint.mode=replay with trainer.precision='16-mixed'"),
    ],
)
def test_bad_values_name_the_option(overrides: list[str], message: str) -> None:
    cfg = _compose(overrides)
    with pytest.raises(ValueError, match=None) as err:
        to_train_config(cfg)
    assert message in str(err.value)


@pytest.mark.parametrize("data_parallel", ["ddp", "zero2", "fsdp2", "hsdp"])
def test_the_recipe_trains_its_module_with_the_configured_data_parallel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_parallel: str
) -> None:
    fitted: list[L.LightningModule] = []
    monkeypatch.setattr(training, "fit", lambda cfg, module, data, output_dir: fitted.append(module))
    cfg = to_train_config(_compose([f"trainer.data_parallel={data_parallel}"]))
    training.run(cfg, tmp_path)
    assert [module.data_parallel for module in fitted] == [data_parallel]
    strategy = training.build_trainer(cfg, tmp_path).strategy
    assert isinstance(strategy, ModelParallelStrategy) == (data_parallel in ("fsdp2", "hsdp"))


def test_checkpoint_config_validates_without_hydra() -> None:
    with pytest.raises(ValueError, match="checkpoint.retention must be >= 1"):
        CheckpointConfig(retention=0)
    assert CheckpointConfig(k_snapshot=4, k_persist=4).k_persist == 4


def test_an_s3_store_and_its_endpoint_compose() -> None:
    storage = ["checkpoint.storage.backend=tensorstore", "checkpoint.storage.url=s3://bucket/run1",
               "checkpoint.storage.endpoint=http://minio.cluster:9000"]  # fmt: skip
    cfg = to_train_config(_compose(storage)).checkpoint.storage
    assert (cfg.backend, cfg.url, cfg.endpoint) == ("tensorstore", "s3://bucket/run1", "http://minio.cluster:9000")
    assert to_train_config(_compose([])).checkpoint.storage.endpoint == "", "empty: the AWS environment's"


@pytest.mark.parametrize("devices", [1, 2])
def test_replay_mode_composes_under_ddp(devices: int) -> None:
    cfg = to_train_config(_compose(["checkpoint.mode=replay", "checkpoint.replay.window=8", f"trainer.devices={devices}"]))
    assert (cfg.checkpoint.mode, cfg.checkpoint.replay.window, cfg.trainer.data_parallel) == ("replay", 8, "ddp")
    assert to_train_config(_compose([])).checkpoint.mode == "pec"
    auto = to_train_config(_compose(["checkpoint.mode=replay", "checkpoint.replay.window=auto", "trainer.devices=1"]))
    assert auto.checkpoint.replay.window == "auto"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_replay_mode_composes_under_zero2(precision: str) -> None:
    overrides = ["checkpoint.mode=replay", "trainer.data_parallel=zero2", f"trainer.precision={precision}"]
    cfg = to_train_config(_compose(overrides))
    assert (cfg.checkpoint.mode, cfg.trainer.data_parallel, cfg.trainer.precision) == ("replay", "zero2", precision)


@pytest.mark.parametrize("data_parallel", ["fsdp2", "hsdp"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_replay_mode_composes_under_the_sharded_modes(data_parallel: str, precision: str) -> None:
    overrides = ["checkpoint.mode=replay", f"trainer.data_parallel={data_parallel}", f"trainer.precision={precision}"]
    cfg = to_train_config(_compose(overrides))
    chosen = (cfg.checkpoint.mode, cfg.trainer.data_parallel, cfg.trainer.precision)
    assert chosen == ("replay", data_parallel, precision)


def _hf_train_config(overrides: list[str]):
    """``conf/train_hf.yaml`` composed and turned into objects (needs the hf extra)."""
    pytest.importorskip("transformers", reason="the hf extra is not installed: pip install 'moc_lightning[hf]'")
    from moc_lightning.jobs.training_hf import TrainHFConfig
    from moc_lightning.jobs.training_hf import register_configs as register_hf_configs

    register_hf_configs()
    return to_train_config(_compose(overrides, root="train_hf"), TrainHFConfig)


@pytest.mark.parametrize("option", HF_MODELS)
def test_every_hf_model_composes(option: str) -> None:
    train = _hf_train_config([f"model={option}"])
    assert train.model.model_type == option.removeprefix("hf_").removesuffix("_tiny")
    assert train.model.num_experts() == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+model.config.num_local_expert=8"], "num_local_expert: did you mean 'num_local_experts'?"),
        (["model.model_type=mixtrall"], "model.model_type='mixtrall' is not a transformers model type"),
        (["model=hf_qwen3_moe_tiny", "model.model_type=llama"], "model.config has options"),
        (["trainer.ep=2"], "trainer.ep=2: a Hugging Face model trains data-parallel here"),
        (["checkpoint.k_snapshot=9"], "checkpoint.k_snapshot=9 must be <= the number of experts per MoE layer (8)"),
    ],
)
def test_bad_hf_values_name_the_option(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError) as err:
        _hf_train_config(overrides)
    assert message in str(err.value)


def test_the_hf_recipe_trains_its_module_with_the_configured_data_parallel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _hf_train_config(["trainer.data_parallel=zero2"])
    from moc_lightning.jobs import training_hf

    fitted: list[L.LightningModule] = []
    monkeypatch.setattr(training_hf, "fit", lambda cfg, module, data, output_dir: fitted.append(module))
    training_hf.run_hf(config, tmp_path)
    assert [module.data_parallel for module in fitted] == ["zero2"]
