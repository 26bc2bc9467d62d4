"""``train.py plan`` and its memory model (:mod:`iprox_lightning.analysis.memory`) against brute-force counts."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iprox_lightning.analysis import memory as M
from iprox_lightning.errors import UserInputError
from iprox_lightning.models.tiny import tiny_config

# parameter counts the model cards publish
PUBLISHED = {"smollm2-135m": 134_515_008, "gemma-3-270m": 268_098_176, "llama-3.2-1b": 1_235_814_400,
             "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("name", sorted(M.NAMED_SHAPES))
def test_named_shapes_have_transformers_and_published_parameter_counts(name):
    from transformers import AutoModelForCausalLM

    config = M.load_config(name)
    with torch.device("meta"):
        counted = AutoModelForCausalLM.from_config(config).num_parameters()
    sizes = M.ModelSizes.from_config(config)
    assert sizes.params == counted == PUBLISHED[name]


def _tiny_model(arch="llama"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(arch)
    return config, AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _real_saved_bytes(model, batch_size, seq_len, precision):
    """Brute force: the real model's saved tensors (non-parameter storages) in one forward of the decoder."""
    model = model.to(torch.bfloat16 if precision == "bf16-true" else torch.float32).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model.get_decoder()(inputs_embeds=emb, attention_mask=torch.ones_like(ids), use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("precision", M.PRECISIONS)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fake_counted_activations_equal_a_real_run_at_other_depth_and_batch(arch, precision):
    # counted on fake tensors with 1-2 layers and 1-2 sequences, extrapolated to the real model's depth and batch 3
    config, model = _tiny_model(arch)
    acts = M.saved_activation_bytes(config, seq_len=24, precision=precision)
    predicted = acts.total(config.num_hidden_layers, 3)
    assert predicted == _real_saved_bytes(model, 3, 24, precision)
    if precision == "bf16-mixed":  # the autocast copies of the weights do not grow with the batch
        assert acts.fixed_per_layer > 0


def test_weights_gradients_and_adamw_equal_a_real_step():
    from iprox_lightning.training.causal_lm import decay_param_groups, freeze_embeddings_and_head

    config, model = _tiny_model()
    freeze_embeddings_and_head(model)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(decay_param_groups(model, 0.01), lr=1e-3)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    moments = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    sizes = M.ModelSizes.from_config(config)
    run = M.RunSettings(max_length=16, batch_size=2, device_kind="cpu")
    acts = M.saved_activation_bytes(config, seq_len=16, precision="32-true")
    parts = M.training_plan(sizes, acts, run, stage="warm-up", n_examples=4).parts
    assert parts["weights"] == weights and parts["adamw"] == moments
    assert sizes.trainable * 4 == grads


def test_fsdp_divides_the_sharded_state_and_bf16_true_halves_it():
    config = M.load_config("llama-3.2-1b")
    sizes = M.ModelSizes.from_config(config)
    acts = M.Activations(outside=0, per_layer=0, layer_input=0)
    one = M.training_plan(sizes, acts, M.RunSettings(), stage="warm-up", n_examples=1).parts
    eight = M.training_plan(sizes, acts, M.RunSettings(devices=8, strategy="fsdp"), stage="warm-up",
                            n_examples=1).parts
    half = M.training_plan(sizes, acts, M.RunSettings(precision="bf16-true"), stage="warm-up", n_examples=1).parts
    assert eight["adamw"] * 8 == one["adamw"] == half["adamw"] * 2 == 2 * 4 * sizes.trainable
    assert eight["weights"] == sizes.params * 4 / 8 + 2 * sizes.largest_block * 4


def test_the_fsdp_store_build_counts_the_sharded_weights_as_scoring_does():
    """``build_store --strategy fsdp`` shards the model per decoder block as the scorer does: the store build's
    weights are the shard, the root's weights, two gathered blocks and FSDP2's gather transient (the larger of the
    root and a block once more: a group's all-gather buffer beside its unsharded copy; scoring's under fsdp), with no
    DDP broadcast; the DDP row keeps the whole weights and the broadcast."""
    config = M.load_config("llama-3.1-8b")
    sizes = M.ModelSizes.from_config(config)
    acts = M.Activations(outside=0, per_layer=0, layer_input=0)
    common = dict(precision="bf16-mixed", devices=8)
    ddp = M.store_plan(sizes, acts, M.RunSettings(**common)).parts
    fsdp = M.store_plan(sizes, acts, M.RunSettings(**common, strategy="fsdp")).parts
    scoring = M.scoring_plan(sizes, acts, M.RunSettings(**common, strategy="fsdp"), "tracin").parts
    root = sizes.params - config.num_hidden_layers * sizes.largest_block
    gathered = root + 2 * sizes.largest_block + max(root, sizes.largest_block)
    assert fsdp["weights"] == scoring["weights"] == 4 * (sizes.params / 8 + gathered)
    assert "weights_broadcast" not in fsdp and fsdp["weights"] < ddp["weights"] == 4 * sizes.params
    assert ddp["weights_broadcast"] == M.ddp_state_broadcast_bytes(sizes, 4)  # (acts 0: the broadcast is larger)
    one = M.store_plan(sizes, acts, M.RunSettings(precision="bf16-mixed", strategy="fsdp")).parts
    assert one["weights"] == 4 * sizes.params  # one device: nothing sharded


def test_a_stage_that_cannot_fit_is_refused_with_the_setting_to_change(capsys):
    from iprox_lightning.commands.plan import plan

    with pytest.raises(UserInputError) as e:
        plan(model="smollm2-135m", max_length=2048, batch_size=64, device_memory="24GB", speed_results="/nonexistent")
    msg = str(e.value)
    assert "warm-up needs" in msg and "data.batch_size / data.max_length" in msg and "\n" not in msg
    assert "NO" in capsys.readouterr().out
    # the same run with activation checkpointing and a smaller batch (Stage 2: one-row micro-batches) fits: no error
    rows = plan(model="smollm2-135m", max_length=512, batch_size=2, gradient_checkpointing=True,
                align_micro_batch_size=1, device_memory="24GB", speed_results="/nonexistent")
    assert all(r["peak"] <= 24e9 for r in rows if not r["stage"].startswith(("scoring (kfac", "scoring (ekfac")))


def test_kfac_refusal_names_the_method_not_the_examples():
    """At 1B, T 128, batch 1 the float32 factors (14.3 GiB) and one pass's sums (14.3 GiB) do not fit 32 GB: the
    refusal names the K-FAC levers (offload, the method), not ``kfac_examples``; partitioned and offloaded, it fits.
    (The fit's sums and the scoring's validation gradients are not held together: 35.7 GiB, which 40 GB holds.)"""
    from iprox_lightning.commands.plan import plan

    kw = dict(model="llama-3.2-1b", max_length=128, batch_size=1, align_batch_size=1, method="kfac",
              device_memory="32GB", speed_results="/nonexistent")
    with pytest.raises(UserInputError, match=r"scoring \(kfac\) needs .*kfac_offload true.*method tracin") as e:
        plan(**kw)
    assert "kfac_examples" not in str(e.value).split("change", 1)[1]
    one = {r["stage"]: r["parts"] for r in plan(**{**kw, "device_memory": None})}["scoring (kfac)"]
    four = {r["stage"]: r["parts"] for r in plan(**kw, kfac_partitions=4, kfac_offload=True)}["scoring (kfac)"]
    # the fit's peak: the last MLP weight's decomposition, beside every factor made before it (float32 eigenvectors,
    # in² + out²: 14.3 GiB in all, 14.0 before the last weight's 0.27) and the one pass's sums
    assert one["kfac_factors"] == pytest.approx(14.02 * 2 ** 30, rel=0.005) and "kfac_eigh" in one
    assert four["kfac_factors"] < 2 ** 30  # on the host; the device holds one layer's whitening while applied
    # partitioned, the fit holds less than the scoring: the stage counts the scoring's parts, the metric its sums
    assert "kfac_factor_sums" not in four and "validation_gradients" in four
    from iprox_lightning.scoring import ScoringConfig
    from iprox_lightning.scoring.metrics import KFAC

    linears = [(l.in_features, l.out_features) for l in M.ModelSizes.from_config(M.load_config("llama-3.2-1b")).shape.linears
               if l.tracked]
    sums = [KFAC.memory_parts(linears, ScoringConfig(method="kfac", kfac_partitions=n))["kfac_factor_sums"] for n in (1, 4)]
    assert sums[0] == one["kfac_factor_sums"] and 0.25 <= sums[1] / sums[0] < 0.3  # the largest of 4 balanced groups


def test_cli_prints_every_stage_and_measured_time_where_known(tmp_path, capsys):
    import json

    from iprox_lightning.cli import main

    sizes = M.ModelSizes.from_config(M.load_config("smollm2-135m"))
    (tmp_path / "speed_x.json").write_text(json.dumps({"device": "cpu", "params": sizes.params,
                                                        "tokens_per_s": {"a": 100.0, "c2": 50.0}}))
    main(["plan", "--model", "smollm2-135m", "--accelerator", "cpu", "--max_length", "64", "--pool_size", "1000",
          "--speed_results", str(tmp_path), "--output", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    for stage in ("warm-up", "build_proxy: Stage 1 (IPSVD)", "build_proxy: Stage 2 (alignment)", "scoring (tracin)",
                  "scoring (kfac)", "scoring (ekfac)", "store build", "fine-tune"):
        assert f"  {stage} " in out
    rows = {r["stage"]: r for r in json.loads((tmp_path / "plan.json").read_text())["stages"]}
    # scoring: 1000 pool + 300 validation examples x 64 tokens at the measured 100 tokens/s
    assert rows["scoring (tracin)"]["seconds"] == pytest.approx((1000 + 300) * 64 / 100.0, rel=0.01)
    assert "measured" in rows["warm-up"]["time_source"] and "FLOPs at the measured" in rows["store build"]["time_source"]


def test_parse_bytes_and_bad_input():
    assert M.parse_bytes("80GB") == 80e9 and M.parse_bytes("1.5 GiB") == 1.5 * 2**30 and M.parse_bytes("24e9") == 24e9
    with pytest.raises(UserInputError, match="device_memory"):
        M.parse_bytes("eighty")
    with pytest.raises(UserInputError, match="precision"):
        M.RunSettings(precision="fp8")
    with pytest.raises(UserInputError, match="model: "):
        M.load_config("/nonexistent/model.gguf")


def test_plan_counts_each_architecture_once_and_reads_them_back(tmp_path, monkeypatch):
    """Issue 65: a plan took 33-36 s, most of it counting activations on fake tensors and importing transformers and
    Lightning. The counts are saved per config, T, precision and versions under $IPROX_CACHE/plan and read back
    without transformers (the second call counts nothing); another T or precision is counted anew."""
    import subprocess
    import sys

    monkeypatch.setenv("IPROX_CACHE", str(tmp_path))
    run = M.RunSettings(max_length=64, precision="bf16-mixed")
    sizes, acts, acts32 = M.model_counts("smollm2-135m", run)
    assert len(list((tmp_path / "plan").glob("*.json"))) == 1
    config = M.load_config("smollm2-135m")
    assert acts == M.saved_activation_bytes(config, seq_len=64, precision="bf16-mixed")
    assert acts32 == M.saved_activation_bytes(config, seq_len=64, precision="32-true")
    assert sizes == M.ModelSizes.from_config(config, name="smollm2-135m")

    def counted(*a, **k):
        raise AssertionError("counted again")

    monkeypatch.setattr(M, "saved_activation_bytes", counted)
    monkeypatch.setattr(M.ModelSizes, "from_config", counted)
    assert M.model_counts("smollm2-135m", run) == (sizes, acts, acts32)
    with pytest.raises(AssertionError, match="counted again"):
        M.model_counts("smollm2-135m", M.RunSettings(max_length=65, precision="bf16-mixed"))
    # the command line, in a fresh process: neither transformers nor Lightning is imported on a cached plan
    code = ("import sys; from iprox_lightning.cli import main; "
            "main(['plan', '--model', 'smollm2-135m', '--max_length', '64', '--precision', 'bf16-mixed']); "
            "print(sorted(m for m in ('transformers', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "IPROX_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}).stdout
    assert out.splitlines()[-1] == "[]", out


def test_plan_states_its_assumptions_units_and_times_and_never_advises_a_setting_in_use(capsys):
    """Without --device_memory the plan says what it assumed; with it, the GB -> GiB conversion; a time without a
    measured throughput is labelled as FLOPs; the refusal of a run already on FSDP over 8 devices asks for more
    devices, not for FSDP, and one already in bf16-true or with checkpointing is not told to use them."""
    from iprox_lightning.commands.plan import plan

    plan(model="smollm2-135m", max_length=64, speed_results="/nonexistent")
    out = capsys.readouterr().out
    assert ("device memory: not given (--device_memory, e.g. 80GB): assumed 1 cuda device(s) of any size, so the fits "
            "column is not checked (-)") in out
    assert "FLOPs (no measured throughput)" in out
    with pytest.raises(UserInputError) as e:
        plan(model="llama-3.1-8b", precision="bf16-mixed", devices=8, strategy="fsdp", device_memory="80GB",
             speed_results="/nonexistent")
    out, msg = capsys.readouterr().out, str(e.value)
    assert "device memory: 80GB = 74.51 GiB per device (GB = 10^9 bytes, GiB = 2^30 bytes" in out
    assert "more than the device's 74.51 GiB (80GB; " in msg
    assert "strategy fsdp" not in msg and "more devices (fsdp over 8 now)" in msg
    with pytest.raises(UserInputError) as e:
        plan(model="llama-3.1-8b", precision="bf16-true", devices=8, strategy="fsdp", device_memory="80GB",
             gradient_checkpointing=True, speed_results="/nonexistent")
    msg = str(e.value)
    assert "bf16-true" not in msg.split("change ", 1)[1] and "model.gradient_checkpointing" not in msg
    assert "strategy fsdp" not in msg


def test_plan_times_the_warm_up_and_fine_tune_epochs_the_configs_run(tmp_path):
    """The plan's warm-up and fine-tune epochs default to the shipped configs' ``trainer.max_epochs`` (before, it
    timed one fine-tune epoch where configs/finetune.yaml runs 4, and LESS's 4 warm-up epochs as one), and each
    stage's time is its examples x epochs x T at the measured tokens/s."""
    import inspect
    import json

    import yaml

    from iprox_lightning.commands.plan import plan

    root = Path(__file__).resolve().parents[1]
    epochs = {name: yaml.safe_load((root / "configs" / f"{name}.yaml").read_text())["trainer"]["max_epochs"]
              for name in ("warmup", "finetune")}
    defaults = {k: p.default for k, p in inspect.signature(plan).parameters.items()}
    assert (defaults["warmup_epochs"], defaults["finetune_epochs"]) == (epochs["warmup"], epochs["finetune"])
    assert (M.RunSettings().warmup_epochs, M.RunSettings().finetune_epochs) == (epochs["warmup"], epochs["finetune"])
    less = yaml.safe_load((root / "configs" / "less" / "warmup.yaml").read_text())["trainer"]["max_epochs"]

    sizes = M.ModelSizes.from_config(M.load_config("smollm2-135m"))
    (tmp_path / "speed_x.json").write_text(json.dumps({"device": "cpu", "params": sizes.params,
                                                        "tokens_per_s": {"a": 100.0, "c2": 50.0}}))
    kw = dict(model="smollm2-135m", accelerator="cpu", max_length=64, pool_size=1000, select_k=40,
              speed_results=str(tmp_path))
    rows = {r["stage"]: r for r in plan(**kw, output=str(tmp_path / "a.json"))}
    less_rows = {r["stage"]: r for r in plan(**kw, warmup_epochs=less, finetune_epochs=2,
                                                output=str(tmp_path / "b.json"))}
    # 50 warm-up examples (5% of 1000) and 40 fine-tune examples of 64 tokens at the measured 50 tokens/s
    assert rows["warm-up"]["seconds"] == pytest.approx(50 * epochs["warmup"] * 64 / 50.0, rel=1e-6)
    assert rows["fine-tune"]["seconds"] == pytest.approx(40 * epochs["finetune"] * 64 / 50.0, rel=1e-6)
    assert less_rows["warm-up"]["seconds"] == pytest.approx(50 * less * 64 / 50.0, rel=1e-6)
    assert less_rows["fine-tune"]["seconds"] == pytest.approx(40 * 2 * 64 / 50.0, rel=1e-6)
    assert less_rows["warm-up"]["peak"] == rows["warm-up"]["peak"]  # epochs are time, not memory
