"""DeepSeek-V3's multi-token prediction (issue #40), in one process: which target each depth gets, what the modules
share with the model, that their loss is transformers' own MTP layer's and reaches the block and the shared embedding
on its own, and that the DeepSeek-layout export loads back (into the training module and into transformers' MtpModel,
an independent reader of DeepSeek-V3's layout). The 3-process, resume and export proofs of real ZeRO-3 runs are in
test_moe.py, whose deepseek-v3-tiny runs train one MTP module (the v3 presets' default)."""

import pytest
import torch
import torch.nn.functional as F

import train
from deepseek_zero3.model import lmloss, mtp, models
from deepseek_zero3.planning import model_math

EOS = 0


def build(preset: str, depth: int, seed: int = 0, vocab: int = 512):
    from transformers import AutoModelForCausalLM

    c = models.load_model_config(preset, "", 32, {"vocab_size": vocab, "eos_id": EOS})
    torch.manual_seed(seed)
    model = models.scale_residual_init(AutoModelForCausalLM.from_config(c, attn_implementation="sdpa"))
    if depth:
        mtp.attach(model, depth, seed)
    return model


def depth_losses(model, batch, cfg) -> torch.Tensor:
    """[main, depth 1, ..] mean losses with their graphs, as train.lm_loss computes them outside training (no step
    scale), for the tests that backpropagate one of them alone."""
    inputs, targets, positions = batch
    depths = mtp.depth_targets(inputs, targets, positions, cfg.mtp_depth)
    nll, n = lmloss.model_nll(model, inputs, targets, cfg.loss_chunk_tokens, positions, depths)
    return (nll / n).float()


def test_each_depth_predicts_the_token_k_plus_one_ahead():
    sequence = torch.tensor([[10, 11, 12, EOS, 13, 14, 15, 16]])  # two documents: 10 11 12 EOS | 13 14 15 16
    inputs, targets = sequence[:, :-1], sequence[:, 1:]
    (ahead1, depth1), (ahead2, depth2) = mtp.depth_targets(inputs, targets, None, 2)
    # Without document masking (DeepSeek-V3's packing): position i reads t_{i+k} and predicts t_{i+k+1}.
    assert ahead1.tolist() == [[11, 12, EOS, 13, 14, 15, 0]] and depth1.tolist() == [[12, EOS, 13, 14, 15, 16, -100]]
    assert ahead2.tolist() == [[12, EOS, 13, 14, 15, 0, 0]] and depth2.tolist() == [[EOS, 13, 14, 15, 16, -100, -100]]
    for k, target in ((1, depth1), (2, depth2)):
        scored = [i for i in range(7) if target[0, i] != -100]
        assert all(target[0, i] == sequence[0, i + k + 1] for i in scored)
    # With it, a position's hidden state has seen only its document: no token k ahead from the next one.
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    (_, depth1), (_, depth2) = mtp.depth_targets(inputs, targets, positions, 2)
    assert depth1.tolist() == [[12, EOS, 13, -100, 15, 16, -100]]
    assert depth2.tolist() == [[EOS, 13, -100, -100, 16, -100, -100]]


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3-tiny"])
def test_modules_share_the_embedding_and_head_and_the_planner_counts_them(preset):
    model = build(preset, 2)
    modules = mtp.modules_of(model)
    assert len(modules) == 2 and all(type(m).__name__ == "MtpLayer" for m in modules)
    block = modules[0].mtp_block
    assert type(block) is type(model.model.layers[-1])  # the model's own layer class
    if preset == "deepseek-v3-tiny":
        assert type(block.mlp).__name__ == "DeepseekV3MoE"  # MoE, as the main model's last layers
    own = {id(p) for p in modules.parameters()}
    assert id(model.get_input_embeddings().weight) not in own and id(model.lm_head.weight) not in own
    names = list(model.state_dict())
    assert sum("embed_tokens" in n for n in names) == 1 and sum("lm_head" in n for n in names) <= 1
    counts = model_math.param_counts(model.config, 2)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["mtp"] == sum(p.numel() for p in modules.parameters())
    # The main model's weights are those of a run without MTP (the modules draw from a stream of their own).
    plain = build(preset, 0)
    assert all(torch.equal(p, plain.state_dict()[k]) for k, p in model.state_dict().items() if not k.startswith("mtp."))


def test_published_v3_mtp_module_size():
    """DeepSeek-V3's released checkpoint holds 685B parameters, 671B of the main model and 14B of its MTP module with
    its own copies of the embedding and head (deepseek-ai/DeepSeek-V3's README, rounded): counted here 671.0B and
    684.5B (a dense block in place of the MoE one would give 673.5B)."""
    c = models.load_model_config("deepseek-v3-671b", "", 4096, None)
    main, with_mtp = model_math.param_counts(c), model_math.param_counts(c, 1)
    copies = 2 * c.vocab_size * c.hidden_size
    assert main["total"] / 1e9 == pytest.approx(671, abs=0.5)
    assert (with_mtp["total"] + copies) / 1e9 == pytest.approx(685, abs=1)
    assert with_mtp["activated"] - main["activated"] < with_mtp["mtp"] / 10  # 8 of 256 routed experts per token


def reference_mtp_loss(model, inputs, targets, positions):
    """Depth 1's loss through transformers' own MtpLayer with our weights, called as its MtpModel calls it (the
    embedding of the token ahead, the main model's last hidden state, rotary embeddings of the positions), with a
    block-causal mask built here from the positions when documents are masked."""
    from transformers.modeling_layers import MtpModel

    model.config.num_mtp_layers = 1
    reference = MtpModel(model, 1)
    reference.layers.load_state_dict(mtp.modules_of(model).state_dict())
    ((ahead, target),) = mtp.depth_targets(inputs, targets, positions, 1)
    hidden = model.model(input_ids=inputs, position_ids=positions, use_cache=False).last_hidden_state
    mask = None
    if positions is not None:
        document = (positions == 0).cumsum(-1)
        causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool).tril()
        mask = (document[:, :, None] == document[:, None, :]) & causal
        mask = mask[:, None]
    positions = torch.arange(inputs.shape[1])[None] if positions is None else positions
    embeds = model.get_input_embeddings()(ahead)
    rotary = reference.rotary_emb(embeds, positions)
    hidden = reference.layers[0](embeds, hidden, rotary, mask, positions, None)
    return F.cross_entropy(model.lm_head(hidden).flatten(0, 1), target.flatten(), ignore_index=-100)


def test_mtp_loss_is_transformers_mtp_layers_and_reaches_block_and_embedding_alone():
    model = build("deepseek-v3-tiny", 1).train()
    torch.manual_seed(1)
    inputs = torch.randint(1, 512, (2, 32))
    targets = torch.randint(1, 512, (2, 32))
    cfg = train.Config(mtp_depth=1, loss_chunk_tokens=16)  # two chunks of 32 tokens
    losses = depth_losses(model, (inputs, targets, None), cfg)
    assert losses.shape == (2,)
    reference = reference_mtp_loss(model, inputs, targets, None)
    assert float(losses[1].detach()) == pytest.approx(float(reference), rel=1e-5)
    losses[1].backward()  # the MTP loss alone
    grads = {k: p.grad for k, p in model.named_parameters()}
    block = [k for k in grads if k.startswith("mtp.0.mtp_block.self_attn")]
    assert block and all(grads[k] is not None and grads[k].abs().sum() > 0 for k in block)
    assert grads["mtp.0.eh_proj.weight"].abs().sum() > 0 and grads["lm_head.weight"].abs().sum() > 0
    assert grads["model.embed_tokens.weight"][inputs[:, 1:].unique()].abs().sum() > 0
    model.zero_grad(set_to_none=True)
    depth_losses(model, (inputs, targets, None), cfg)[0].backward()  # the main loss alone: nothing reaches MTP
    assert all(p.grad is None or not p.grad.any() for p in mtp.modules_of(model).parameters())
    assert float(mtp.objective(losses.detach(), 0.3)) == pytest.approx(float(losses[0] + 0.3 * losses[1]))


def test_gradient_checkpointing_and_document_masking_keep_the_mtp_loss():
    inputs = torch.tensor([[5, 6, 7, EOS, 8, 9, 10, 11] * 4])
    targets = torch.roll(inputs, -1, 1)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3] * 4])
    grads = []
    for checkpointing in (False, True):
        model = build("deepseek-v3-tiny", 1).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        losses = depth_losses(model, (inputs, targets, positions), train.Config(mtp_depth=1))
        mtp.objective(losses, 0.3).backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if k.startswith("mtp.")})
        masked = reference_mtp_loss(model, inputs, targets, positions)
        assert float(losses[1].detach()) == pytest.approx(float(masked), rel=1e-5)
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


@pytest.mark.parametrize("preset", ["tiny", "tiny-qk-norm", "deepseek-v3-tiny"])
def test_the_export_loads_back_and_transformers_reads_deepseeks_layout(preset, tmp_path):
    from safetensors.torch import load_file, save_file

    trained = build(preset, 1, seed=0)
    with torch.no_grad():
        for p in mtp.modules_of(trained).parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not an initial draw: norms away from 1
    path = tmp_path / mtp.EXPORT_FILE
    exported = mtp.export_weights(trained, trained.state_dict())
    n = trained.config.num_hidden_layers
    assert all(k.startswith(f"model.layers.{n}.") for k in exported)
    assert {f"model.layers.{n}.{k}.weight" for k in ("enorm", "hnorm", "eh_proj", "shared_head.norm")} <= set(exported)
    save_file(exported, path)
    fresh = build(preset, 1, seed=0)
    fresh.load_state_dict({k: v for k, v in trained.state_dict().items() if not k.startswith("mtp.")}, strict=False)
    assert not torch.equal(fresh.mtp[0].eh_proj.weight, trained.mtp[0].eh_proj.weight)
    mtp.load_exported(fresh, path)
    assert all(torch.equal(p, fresh.state_dict()[k]) for k, p in trained.state_dict().items())
    if preset == "deepseek-v3-tiny":  # transformers' own reader of DeepSeek-V3's MTP layout
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_layers import MtpModel
        from transformers.modeling_utils import LoadStateDictConfig

        trained.config.num_mtp_layers = 1
        reader = MtpModel(trained, 1)
        mapping = reader.get_weight_conversions(trained)
        config = LoadStateDictConfig(weight_mapping=mapping)
        info, _ = convert_and_load_state_dict_in_model(reader, load_file(path), config)
        reader._adjust_missing_and_unexpected_keys(info)  # as its from_pretrained: the embedding and head are shared
        assert not info.missing_keys and not info.unexpected_keys, info
        assert all(torch.equal(p, trained.mtp[0].state_dict()[k]) for k, p in reader.layers[0].state_dict().items())
    broken = load_file(path)
    broken.pop(f"model.layers.{n}.enorm.weight")
    save_file(broken, tmp_path / "broken.safetensors")
    with pytest.raises(ValueError, match="enorm"):
        mtp.load_exported(fresh, tmp_path / "broken.safetensors")


def test_flags_and_what_a_resume_keeps():
    from deepseek_zero3.cli import UserError
    from deepseek_zero3.run_dir import checkpoint

    refused = [({"mtp_depth": -2}, "--mtp_depth -2 must be -1"), ({"mtp_depth": 8, "seq_len": 8}, "below --seq_len 8"),
               ({"mtp_loss_weight": -0.1}, "--mtp_loss_weight -0.1 must not be negative"),
               ({"mtp_loss_weight": float("nan")}, "--mtp_loss_weight nan must be a finite number"),
               ({"mtp_loss_weight": float("inf")}, "--mtp_loss_weight inf must be a finite number")]  # fmt: skip
    for flags, said in refused:
        with pytest.raises(UserError, match=said):
            train.check_flags(train.Config(**flags))
    before_mtp = {"seq_len": 32, "lr": 1e-3}  # a checkpoint written before the flag: it trained no module
    cfg, taken, _ = checkpoint.config_for_resume(train.Config(), set(), before_mtp)
    assert cfg.mtp_depth == 0 and taken["mtp_depth"] == 0
    with pytest.raises(UserError, match="trained with --mtp_depth 0, this command gives --mtp_depth 1"):
        checkpoint.config_for_resume(train.Config(mtp_depth=1), {"mtp_depth"}, before_mtp)
    # --mtp_depth -1 given again (the command the run printed when stopped) means the run's own, resolved depth
    assert checkpoint.config_for_resume(train.Config(), {"mtp_depth"}, {"mtp_depth": 1})[0].mtp_depth == 1
    _, _, changed = checkpoint.config_for_resume(train.Config(mtp_loss_weight=0.1), {"mtp_loss_weight"},
                                                 {"mtp_depth": 1, "mtp_loss_weight": 0.3})  # fmt: skip
    assert changed == {"mtp_loss_weight": [0.3, 0.1]}  # DeepSeek-V3's lambda late in training


def test_half_precision_weights_train_the_modules():
    """bf16 weights (as DeepSpeed's bf16 mode holds them): the modules' loss is finite and reaches them."""
    model = build("deepseek-v3-tiny", 1).to(torch.bfloat16).train()
    inputs = torch.randint(1, 512, (2, 16))
    losses = depth_losses(model, (inputs, torch.roll(inputs, -1, 1), None), train.Config(mtp_depth=1))
    assert losses.dtype == torch.float32 and torch.isfinite(losses).all()
    mtp.objective(losses, 0.3).backward()
    assert mtp.modules_of(model)[0].eh_proj.weight.grad.abs().sum() > 0


def test_under_autocast_the_depths_share_one_16_bit_output_weight():
    """Under bf16 autocast (DDP, one process) the main loss and each depth's compute in bf16 from one bf16 copy of the
    output weight, as autocast's cache gives the full-logits path; a copy per depth would hold another vocabulary x
    hidden matrix until backward. Seen failing with a copy made in each loss."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from test_loss import VocabMatmuls
    from test_precision import UNITS

    if not UNITS["bf16"][0]:
        pytest.skip(UNITS["bf16"][1])
    model = build("deepseek-v3-tiny", 2).train()
    weight = model.get_output_embeddings().weight
    copies = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func == torch.ops.aten._to_copy.default and args[0].data_ptr() == weight.data_ptr():
                copies.append(out.dtype)
            return out

    inputs = torch.randint(1, 512, (2, 32))
    with VocabMatmuls(model.config.vocab_size) as seen, Copies():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = depth_losses(model, (inputs, torch.roll(inputs, -1, 1), None), train.Config(mtp_depth=2))
        mtp.objective(losses, 0.3).backward()
    assert copies == [torch.bfloat16] and seen.dtypes == {torch.bfloat16}, (copies, seen.dtypes)
    assert torch.isfinite(losses).all() and weight.grad.dtype == torch.float32 and weight.grad.abs().sum() > 0


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3-tiny"])
def test_depths_chain_the_block_output_and_a_depth_without_targets_adds_nothing(preset):
    """Depth 2 reads depth 1's block output before its post_norm (the report's h^1; vLLM's DeepSeek MTP chains its
    drafts so): transformers' MtpLayer with its post_norm switched off gives that state; for a Llama's blocks too. A
    step whose documents are too short for depth 2 scores nothing there: its share is 0, not inf x 0."""
    model = build(preset, 2).train()
    torch.manual_seed(2)
    inputs = torch.randint(1, 512, (2, 16))
    targets = torch.randint(1, 512, (2, 16))
    losses = depth_losses(model, (inputs, targets, None), train.Config(mtp_depth=2))
    (ahead1, _), (ahead2, target2) = mtp.depth_targets(inputs, targets, None, 2)
    positions = torch.arange(16)[None]
    with torch.no_grad():
        hidden = model.model(input_ids=inputs, position_ids=positions, use_cache=False).last_hidden_state
        rotary = model.model.rotary_emb(hidden, positions)
        first, second = mtp.modules_of(model)
        first.use_post_norm = False
        h1 = first(model.get_input_embeddings()(ahead1), hidden, rotary, None, positions, None)
        h2 = second(model.get_input_embeddings()(ahead2), h1, rotary, None, positions, None)
    reference = F.cross_entropy(model.lm_head(h2).flatten(0, 1), target2.flatten(), ignore_index=-100)
    assert float(losses[2].detach()) == pytest.approx(float(reference), rel=1e-5)
    one_token_documents = torch.tensor([[5, EOS] * 8])
    batch = (one_token_documents, torch.roll(one_token_documents, -1, 1), torch.tensor([[0, 1] * 8]))
    scale = mtp.step_scale(batch, 2, micro_batches=1)
    assert scale[1] == 1.0  # nothing to score at depth 2: clamped, so its summed NLL (0) stays 0


def test_models_without_mtp_or_llama_layers_still_score():
    """model_nll of a GPT-2 (its decoder blocks are `h`, not `layers`): the MTP capture is not built for it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from deepseek_zero3.model import lmloss

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    ids = torch.randint(0, 64, (1, 16))
    nll, n = lmloss.model_nll(model, ids, ids, 8)
    assert torch.isfinite(nll) and int(n) == 16
