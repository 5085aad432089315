"""DeepSeek-V3's multi-token prediction (MTP; DeepSeek-V3 technical report, arXiv 2412.19437, section 2.2).

D modules in sequence. Module k (1..D) combines, at each position i, the previous depth's hidden state h^{k-1}_i
(h^0: the main model's last hidden state, after its final norm, the one its output layer reads) with the embedding of
the token k ahead, t_{i+k}, runs one transformer block and predicts t_{i+k+1} with the main model's output layer
(eq. 21-23):

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]      h^k = TRM_k(h'^k)      P^k = OutHead(RMSNorm(h^k))

Each module is transformers' own MtpLayer (enorm, hnorm, eh_proj, a decoder layer of the model's class as mtp_block,
post_norm: DeepSeek's shared_head.norm), the layer transformers builds to draft tokens from DeepSeek-V3's released
MTP weights; the embedding and output layer are the main model's tensors, not copies. Its block is the model's own
kind: MLA + MoE for DeepSeek-V3 (its index is past first_k_dense_replace), Llama's for a Llama. The loss of depth k is
the mean NLL over the scored targets of the step's global batch (step_scale), and the objective is the main loss +
lambda / D x the sum over depths (eq. 24-25).

The modules live at `model.mtp` (a ModuleList), so ZeRO-3 partitions them and checkpoints carry them. The export keeps
them out of final/ (a plain model of the main network) and writes them beside it to final/mtp.safetensors in
DeepSeek-V3's layout: module k as decoder layer num_hidden_layers + k - 1, with copies of the embedding and head under
its `embed_tokens` and `shared_head.head` as the released checkpoint stores them (export_weights, load_exported).
"""

from __future__ import annotations

import contextlib
import copy

import torch

ATTR = "mtp"  # model.mtp: the ModuleList of the modules, depth k at index k - 1
EXPORT_FILE = "mtp.safetensors"
OWN = ("enorm.", "hnorm.", "eh_proj.")  # DeepSeek's names of an MTP layer's own tensors outside its block


def modules_of(model) -> torch.nn.ModuleList | None:
    """The MTP modules of a model (unwrapped), or None."""
    return getattr(model, ATTR, None)


def depth_of(flag: int, model_config) -> int:
    """--mtp_depth, or for -1 the model's own: DeepSeek-V3's one module for its architecture, none for a Llama
    (DeepSeek LLM was trained without)."""
    return flag if flag >= 0 else int(getattr(model_config, "model_type", "") == "deepseek_v3")


def attach(model, depth: int, seed: int) -> None:
    """Add `depth` MTP modules to a transformers causal LM, built as it was built (partitioned under ZeRO-3) and
    initialised as its own weights are (transformers' _init_weights, then models.scale_residual_init's residual scale),
    from a random stream of their own: the main model's weights are those of a run without MTP."""
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled
    from transformers.modeling_layers import MtpLayer

    from deepseek_zero3.model import models

    decoder, config = model.get_decoder(), model.config
    layer_cls, norm_cls = type(decoder.layers[-1]), type(decoder.norm)
    if getattr(config, "layer_types", None):  # a layer's kind by its index (Qwen3's): a block is the last layer's kind
        config = copy.deepcopy(config)
        config.layer_types = [*config.layer_types, *config.layer_types[-1:] * depth]
    zero3 = is_deepspeed_zero3_enabled()
    with torch.random.fork_rng(devices=[]), contextlib.ExitStack() as stack:
        torch.manual_seed(seed + 1_000_003)
        if zero3:
            import deepspeed

            stack.enter_context(deepspeed.zero.Init(config_dict_or_path=deepspeed_config()))
        layers = torch.nn.ModuleList(
            MtpLayer(config, layer_cls, norm_cls, config.num_hidden_layers + k) for k in range(depth)
        )
    model.add_module(ATTR, layers)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 1_000_003)
        for module in layers.modules():
            params = [*module.parameters(recurse=False)] + [p for c in module.children() for p in c.parameters(False)]
            if not zero3:
                model._initialize_weights(module)
                continue
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if deepspeed.comm.get_rank() == 0:
                    model._initialize_weights(module)
        models.scale_residual_init(model, within=f"{ATTR}.")


def depth_targets(
    inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None, depth: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each depth k = 1..D: the token k ahead of each position (t_{i+k}, the module's embedding input) and its
    target t_{i+k+1} (the main model's target k positions on); -100 where the window ends first, or, with document
    masking (positions), where t_{i+k} is not in position i's document (its hidden state never saw that document)."""
    out = []
    for k in range(1, depth + 1):
        ahead = torch.cat([inputs[:, k:], torch.zeros_like(inputs[:, :k])], dim=1)
        target = torch.cat([targets[:, k:], torch.full_like(targets[:, :k], -100)], dim=1)
        if positions is not None:
            same_document = positions[:, k:] - positions[:, :-k] == k
            target[:, :-k] = torch.where(same_document, target[:, :-k], -100)
        out.append((ahead, target))
    return out


def step_scale(batch: tuple, depth: int, micro_batches: int) -> torch.Tensor:
    """Per depth: the step's micro-batches (over all processes) / the scored targets of its whole global batch `batch`
    (inputs, targets, positions). A micro-batch's summed NLL times it, averaged over the micro-batches, is the global
    batch's mean per scored target whatever the number of processes: with document masking, sequences score different
    numbers of targets, so a mean of each micro-batch's own means would depend on how the batch is split."""
    scored = torch.stack([(t != -100).sum() for _, t in depth_targets(*batch, depth)])
    return micro_batches / scored.double().clamp(min=1)  # a depth with nothing to score (tiny documents) adds 0


class Capture:
    """What the main model hands its last decoder layer (attention mask, rotary embeddings, position ids): the MTP
    blocks attend over the same positions with the same mask. Recorded by a forward pre-hook while `active`."""

    def __init__(self, model):
        self.kwargs: dict = {}
        self.layer = model.get_decoder().layers[-1]

    def _hook(self, module, args, kwargs):
        self.kwargs = {k: kwargs.get(k) for k in ("attention_mask", "position_embeddings", "position_ids")}

    @contextlib.contextmanager
    def active(self):
        handle = self.layer.register_forward_pre_hook(self._hook, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()
            self.kwargs = {}


def run_depths(model, capture: Capture, hidden: torch.Tensor, depths, nll) -> list[torch.Tensor]:
    """The summed NLL of each depth (nll(hidden states, targets), the main loss's function), run inside the output
    layer's call, on the hidden states it received: under ZeRO-3 its weight is gathered there.

    MtpLayer's own forward, in its parts: the next depth reads the block's output before post_norm (the report's
    h^k = TRM_k(h'^k), with the norm part of the output head, DeepSeek's shared_head.norm, as vLLM's DeepSeek MTP
    layer chains its drafts); transformers' MtpModel hands on the normed state instead. One depth: the same."""
    embed, totals = model.get_input_embeddings(), []
    for module, (ahead, target) in zip(modules_of(model), depths):
        joined = torch.cat([module.enorm(embed(ahead)), module.hnorm(hidden)], dim=-1)
        hidden = module.mtp_block(module.eh_proj(joined), cache=None, **capture.kwargs)
        totals.append(nll(module.post_norm(hidden), target))
    return totals


def objective(losses: torch.Tensor, weight: float) -> torch.Tensor:
    """What is backpropagated: the main loss + weight / D x the sum of the D depths' losses (eq. 25)."""
    if len(losses) == 1:
        return losses[0]
    return losses[0] + weight / (len(losses) - 1) * losses[1:].sum()


# ---------------------------------------------------------------------------------------------------------------------
# The export: DeepSeek-V3's layout, module k as decoder layer num_hidden_layers + k - 1
# ---------------------------------------------------------------------------------------------------------------------


def split_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """(the main model's tensors, the MTP modules' tensors) of a full state dict."""
    prefix = f"{ATTR}."
    main = {k: v for k, v in state_dict.items() if not k.startswith(prefix)}
    return main, {k: v for k, v in state_dict.items() if k.startswith(prefix)}


def deepseek_name(key: str, num_hidden_layers: int) -> str:
    """`mtp.{k-1}.X` (our module's name, after transformers' per-expert split) as DeepSeek-V3 names it."""
    _, index, rest = key.split(".", 2)
    layer = f"model.layers.{num_hidden_layers + int(index)}."
    if rest.startswith("mtp_block."):
        return layer + rest.removeprefix("mtp_block.")
    if rest.startswith("post_norm."):
        return layer + "shared_head.norm." + rest.removeprefix("post_norm.")
    return layer + rest


def our_name(key: str, num_hidden_layers: int) -> str | None:
    """The inverse of deepseek_name; None for the embedding and head copies (the main model's own tensors)."""
    parts = key.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    index, rest = int(parts[2]) - num_hidden_layers, parts[3]
    if index < 0 or rest.startswith(("embed_tokens.", "shared_head.head.")):
        return None
    if rest.startswith("shared_head.norm."):
        return f"{ATTR}.{index}.post_norm." + rest.removeprefix("shared_head.norm.")
    return f"{ATTR}.{index}." + (rest if rest.startswith(OWN) else "mtp_block." + rest)


def export_weights(model, state_dict: dict) -> dict:
    """The MTP tensors of a consolidated state dict in DeepSeek-V3's layout: transformers' own save-time conversion
    (DeepSeek-V3's fused experts back to one tensor per expert, as save_pretrained writes the main layers), then the
    layer names; each module also gets the embedding and head, as DeepSeek's released checkpoint stores them."""
    from transformers.core_model_loading import revert_weight_conversion

    main, ours = split_state_dict(state_dict)
    n = model.config.num_hidden_layers
    out = {deepseek_name(k, n): v.contiguous() for k, v in revert_weight_conversion(model, ours).items()}
    head = main.get("lm_head.weight", main["model.embed_tokens.weight"])
    for index in range(len(modules_of(model))):
        out[f"model.layers.{n + index}.embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
        out[f"model.layers.{n + index}.shared_head.head.weight"] = head.clone()
    return out


def load_exported(model, path) -> None:
    """Load final/mtp.safetensors (export_weights' layout) into a model's MTP modules, through transformers' own
    load-time conversion (per-expert tensors fused as from_pretrained fuses them). Raises ValueError when a module's
    tensor is missing or left over, or when its embedding or head copy is not the model's."""
    from safetensors.torch import load_file
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    n, exported = model.config.num_hidden_layers, load_file(str(path))
    main = dict(model.state_dict())
    for key, tensor in exported.items():
        if key.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            own = main["model.embed_tokens.weight" if "embed_tokens" in key else "lm_head.weight"]
            if not torch.equal(own.to(tensor.dtype), tensor):
                raise ValueError(f"{path}: {key} is not the main model's tensor")
    renamed = {our_name(k, n): v for k, v in exported.items() if our_name(k, n) is not None}
    mapping = get_model_conversion_mapping(model, add_legacy=False)
    info, _ = convert_and_load_state_dict_in_model(model, renamed, LoadStateDictConfig(weight_mapping=mapping))
    missing = sorted(k for k in info.missing_keys if k.startswith(f"{ATTR}."))  # the main model's are not in the file
    if missing or info.unexpected_keys:
        raise ValueError(
            f"{path} does not fit the MTP modules: missing {missing[:5]}, left over {sorted(info.unexpected_keys)[:5]}"
        )
