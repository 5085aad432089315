"""What a model writes: prompts continued by transformers' own `generate` (its KV cache, its samplers), for eval.py's
--prompt and for the samples train.py logs at each validation.

    Sampling / check_sampling   --max_new_tokens, --temperature (0: greedy), --top_k, --top_p, --seed, checked
    read_prompt_file            --prompt_file: one prompt per blank-line-separated block
    prompt_ids / check_room     a prompt as the model sees it (after the BOS or EOS token), and its room in the context
    continue_prompts            each prompt continued; the same seed gives the same text
    TrainingSamples             train.py: its prompts (held-out documents' first tokens, or --sample_prompts), continued
                                greedily at each validation by every process together (ZeRO-3 gathers each layer's
                                weights collectively), without touching the random state or the data order

A prompt starts after the BOS token (the EOS where the tokenizer has no BOS): train.py's documents follow an EOS in the
token stream, and eval.py conditions the first scored token on the same token. DeepSeek-V3's MTP modules are not used
(they could draft tokens for speculative decoding; not done here): the continuation is the main model's.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import torch

from deepseek_zero3.cli import UserError, one_line
from deepseek_zero3.model.lmloss import forget_zero3_eval_trace


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a prompt is continued: up to max_new_tokens (fewer when the model writes the EOS token), greedy at
    temperature 0, else sampled with top_k (0: off) and top_p (1: off), the random state seeded with `seed` before
    each prompt, so a prompt's text depends on the seed alone, not on the prompts before it."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def describe(self) -> str:
        how = "greedy" if not self.temperature else f"temperature {self.temperature:g}"
        if not self.temperature and (self.top_k or self.top_p < 1):
            how += " (--top_k and --top_p apply to sampling only: ignored)"
        if self.temperature and self.top_k:
            how += f", top_k {self.top_k}"
        if self.temperature and self.top_p < 1:
            how += f", top_p {self.top_p:g}"
        return f"{how}, seed {self.seed}, up to {self.max_new_tokens} new tokens"

    def generate_kwargs(self) -> dict:
        if not self.temperature:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def check_sampling(s: Sampling) -> None:
    """Each setting on its own terms (the context is checked per prompt, check_room)."""
    if s.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens {s.max_new_tokens} must be at least 1")
    if not 0 <= s.temperature < float("inf"):  # NaN too
        raise UserError(f"--temperature {s.temperature} must be 0 (greedy) or a positive finite number (sampling)")
    if not 0 <= s.seed < 2**63:
        raise UserError(f"--seed {s.seed} must be within [0, 2^63) (torch's random seed)")
    if not 0 < s.top_p <= 1:
        raise UserError(f"--top_p {s.top_p} must be in (0, 1] (1: off): the share of probability mass sampled from")
    if s.top_k < 0:
        raise UserError(f"--top_k {s.top_k} must be 0 (off) or a number of tokens to sample from")


def read_prompt_file(path: str, flag: str = "--prompt_file ") -> list[str]:
    """The prompts of a text file: one per block of lines, blocks separated by blank lines (a prompt may span lines;
    a file of one-line prompts needs a blank line between them). Refused when missing, unreadable or empty."""
    from deepseek_zero3.prepare.documents import split_blank_line_blocks

    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{flag}{path}: no such file; name a text file of prompts (blank-line-separated)") from None
    except IsADirectoryError:
        raise UserError(f"{flag}{path} is a directory; name a text file of prompts (blank-line-separated)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}{path} cannot be read as UTF-8 text ({e}); name a text file of prompts") from None
    prompts = [p for p in split_blank_line_blocks(text) if p.strip()]
    if not prompts:
        raise UserError(
            f"{flag}{path} holds no prompt (only blank lines); write one prompt per blank-line-separated block"
        )
    return prompts


def start_token(tokenizer) -> int:
    """The token a prompt follows: BOS, else EOS."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise UserError("the tokenizer has neither a BOS nor an EOS token to start a prompt after")
    return token


def prompt_ids(tokenizer, prompt: str, where: str) -> list[int]:
    """The token ids of a prompt as the model continues it: the start token, then the prompt's own tokens."""
    if not prompt:  # whitespace is text (an indentation, a newline: what a code model continues)
        raise UserError(f"{where} is empty; give text to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the command line or environment gave that are no UTF-8 character
        raise UserError(f"{where} is not valid UTF-8 text; give the prompt as UTF-8") from None
    return [start_token(tokenizer), *tokenizer(prompt, add_special_tokens=False)["input_ids"]]


def check_room(ids: list[int], max_new_tokens: int, context: int, where: str, flag: str = "--max_new_tokens") -> None:
    """The prompt and its continuation fit the model's context (max_position_embeddings)."""
    if len(ids) >= context:
        raise UserError(f"{where} is {len(ids) - 1} tokens (after the start token), which leaves no room in the "
                        f"model's context of {context} tokens; shorten it")  # fmt: skip
    if len(ids) + max_new_tokens > context:
        raise UserError(f"{flag} {max_new_tokens} after {where} of {len(ids) - 1} tokens (+ the start token) "
                        f"is past the model's context of {context} tokens; lower it to at most "
                        f"{context - len(ids)}")  # fmt: skip


@torch.no_grad()
def continue_ids(model, ids: list[int], sampling: Sampling, eos_id: int, device, synced: bool = False) -> list[int]:
    """One prompt's new token ids, by transformers' generate with its KV cache. synced: every process runs the same
    number of forwards until all have finished (ZeRO-3, where each forward gathers the weights collectively)."""
    inputs = torch.tensor([ids], device=device)
    torch.manual_seed(sampling.seed)  # all devices too: the same seed gives the same text
    out = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
        synced_gpus=synced,
        **sampling.generate_kwargs(),
    )
    return out[0, len(ids) :].tolist()


def continue_prompts(model, tokenizer, prompts: list[list[int]], sampling: Sampling, device, synced=False) -> list:
    """Each prompt's token ids (prompt_ids) continued: [{"prompt", "continuation", "new_tokens", "ended"}] with
    "ended" true where the model closed the document (wrote its EOS token), which is not part of the text."""
    eos = tokenizer.eos_token_id
    results = []
    for ids in prompts:
        new = continue_ids(model, ids, sampling, eos, device, synced)
        ended = bool(new) and new[-1] == eos
        results.append({"prompt": tokenizer.decode(ids[1:]), "continuation": tokenizer.decode(new[: len(new) - ended]),
                        "new_tokens": len(new), "ended": ended})  # fmt: skip
    return results


def shown(sample: dict) -> str:
    """A sample on one line: the prompt in brackets, then the continuation, line breaks escaped."""
    end = " <end of document>" if sample["ended"] else ""
    return f"[{one_line(sample['prompt'])}]{one_line(sample['continuation'])}{end}"


# ---------------------------------------------------------------------------------------------------------------------
# train.py: samples at each validation
# ---------------------------------------------------------------------------------------------------------------------

PROMPT_TOKENS = 16  # the held-out documents' first tokens that make a default prompt
DEFAULT_PROMPTS = 3


def held_out_prompts(sources, eos_id: int, count: int = DEFAULT_PROMPTS) -> list[list[int]]:
    """The first PROMPT_TOKENS tokens of held-out (validation) documents long enough to have more after them, taken
    from the sources in turn: a text the model never trained on, whose real continuation the validation loss scores."""
    found = []
    for source in sources:
        tokens = source.val_tokens
        starts = [0, *(int(i) + 1 for i in (tokens == eos_id).nonzero()[0]), len(tokens)]  # the last one may be cut
        found.append([tokens[a : a + PROMPT_TOKENS].tolist() for a, b in itertools.pairwise(starts)
                      if b - a > PROMPT_TOKENS + 1])  # fmt: skip
    prompts = []
    while len(prompts) < count and any(found):
        for per_source in found:
            if per_source and len(prompts) < count:
                prompts.append([eos_id, *per_source.pop(0)])
    return prompts


def parse_sample_prompts(value: str) -> list[str] | None:
    """train.py --sample_prompts: "" (held-out documents), a prompt of its own, or @FILE (read_prompt_file)."""
    if not value:
        return None
    if value.startswith("@"):
        return read_prompt_file(value[1:], "--sample_prompts @")
    if not value.strip():
        raise UserError("--sample_prompts is blank; give a prompt, @FILE of prompts, or leave it out")
    return [value]


@dataclasses.dataclass
class TrainingSamples:
    """The samples train.py writes at each validation: its prompts continued greedily for a fixed number of tokens."""

    prompts: list[list[int]]
    sampling: Sampling
    tokenizer: object

    @classmethod
    def of_run(cls, cfg, data, tokenizer, context: int) -> TrainingSamples | None:
        """The samples of a run (train.py's Config, its TrainingData and tokenizer), its prompts checked against the
        model's context; None with --sample_tokens 0."""
        if not cfg.sample_tokens:
            return None
        sampling = Sampling(max_new_tokens=cfg.sample_tokens)
        texts = parse_sample_prompts(cfg.sample_prompts)
        eos = data.meta["eos_id"]
        if texts is None:
            prompts = held_out_prompts(data.sources, eos)
        else:
            prompts = [[eos, *prompt_ids(tokenizer, t, "--sample_prompts' prompt")[1:]] for t in texts]
        where = "a held-out document's first tokens" if texts is None else "--sample_prompts' prompt"
        for ids in prompts:
            check_room(ids, cfg.sample_tokens, context, where, "--sample_tokens")
        return cls(prompts, sampling, tokenizer) if prompts else None

    def take(self, model, accelerator) -> tuple[list[dict], float]:
        """The samples of the model as it is now, and the seconds they took. Every process runs generate on the same
        prompts (synced: the same number of forwards on all, which ZeRO-3's collective gathers need); the random state
        of every device is as it was, so training goes on exactly as without samples."""
        t0 = time.perf_counter()
        devices = [accelerator.device] if accelerator.device.type == "cuda" else []
        unwrapped = accelerator.unwrap_model(model)
        model.eval()
        with torch.random.fork_rng(devices=devices):
            samples = continue_prompts(unwrapped, self.tokenizer, self.prompts, self.sampling, accelerator.device,
                                       synced=accelerator.num_processes > 1)  # fmt: skip
        model.train()
        # generate's forwards (other shapes, a KV cache) may have made ZeRO-3 record a forward-only trace: forgotten,
        # as after validation at step 0, so that training's next step records its own (lmloss explains why)
        forget_zero3_eval_trace(model)
        return samples, time.perf_counter() - t0
