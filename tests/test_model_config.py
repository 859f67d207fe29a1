"""One models config group for `cascade.run` and `cascade.train_adapter`: an adapter trained with
the defaults is the one the kangaroo method loads with the defaults."""

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import cascade.run as run_mod
import cascade.train_adapter as train_mod
from cascade.models import load_model
from cascade.models.heads.adapter import ExitAdapter

CONF = Path(__file__).resolve().parents[1] / "conf"


def _compose(name, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_defaults_train_the_exit_kangaroo_runs(tmp_path, monkeypatch):
    """The real defaults (no debug profile): same exit layer, same checkpoint path."""
    monkeypatch.setenv("CASCADE_CACHE", str(tmp_path))
    train_cfg = _compose("train_adapter")
    run_cfg = _compose("config", "+experiment=kangaroo")
    assert train_cfg.train.exit_layer == run_cfg.method.drafter.exit_layer == run_cfg.models.exits.shallow
    assert train_cfg.train.save_to == run_cfg.method.drafter.adapter == str(tmp_path / "adapters" / "qwen2.5-coder-1.5b-exit6.pt")
    # moving the exit moves both
    assert _compose("train_adapter", "models.exits.shallow=8").train.save_to == \
        _compose("config", "+experiment=kangaroo", "models.exits.shallow=8").method.drafter.adapter


def test_train_then_run_kangaroo_loads_the_checkpoint_just_written(tmp_path, monkeypatch):
    """On the tiny models: train (the debug profile's untrained "init" adapter replaced by the
    default path), then run kangaroo; its drafter holds exactly the trained weights."""
    monkeypatch.setenv("CASCADE_CACHE", str(tmp_path / "cache"))
    common = ["debug=tiny", "models.adapter=${models.adapter_path}"]
    train_cfg = _compose("train_adapter", *common, f"output_dir={tmp_path / 'train'}", "progress=false",
                         "train.skip_prompts=0", "train.max_tokens=200", "train.seq_len=32", "train.epochs=1")
    summary = train_mod.train(train_cfg)
    written = Path(train_cfg.train.save_to)
    assert written.is_file() and Path(summary["checkpoint"]).is_file()

    run_cfg = _compose("config", "+experiment=kangaroo", *common, f"output_dir={tmp_path / 'run'}", "progress=false")
    assert Path(run_cfg.method.drafter.adapter) == written
    target = load_model(run_cfg.models.target, run_cfg.models.backend, "cpu")
    drafter = instantiate(run_cfg.method.drafter)
    drafter.check_compatible(target)
    trained = ExitAdapter.load(written, target).state_dict()
    for name, value in drafter.adapter.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert not all(torch.equal(v, ExitAdapter.from_target(target, drafter.exit_layer).state_dict()[n]) for n, v in trained.items())
    run_mod.run(run_cfg)  # and the experiment runs with it
