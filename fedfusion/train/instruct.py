"""LoRA fine-tuning on instruction pairs (:mod:`fedfusion.data.pairs`): chat formatting with the loss on responses
only (:data:`RESPONSE`, the loss plug-in :func:`fedfusion.train.loop.train_steps` trains such data with), and
evaluation / generation on such data (plain torch, no Flower).

Formatting: with a chat template, a pair is the user turn plus the assistant turn as the tokenizer renders
them; the prompt part (everything the template renders before the response, found as the longest common
token prefix of the prompt-with-generation-prompt and the full chat) gets label -100, so the loss covers the
response and the template's end-of-turn tokens only. A tokenizer with no chat template uses
``"Question: {prompt}\\nAnswer: "`` followed by ``"{response}"`` and the eos token, masked the same way.
Sequences are cut at ``max_len`` tokens on the right; a pair with no response token left is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:  # peft imports bitsandbytes: the LoRA client role loads it, not every user of this module
    from peft import PeftModel

from fedfusion.data.pairs import Pair
from fedfusion.data.text import as_text
from fedfusion.models.build import generate
from fedfusion.train.loop import Step

IGNORE = -100
FALLBACK_PROMPT = "Question: {prompt}\nAnswer: "


@dataclass
class InstructData:
    """Encoded pairs, right-padded to one length: ids, labels (-100 outside responses) and attention mask."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    dropped: int = 0  # pairs left out because truncation removed their whole response

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows ``index``, trimmed to their longest sequence."""
        mask = self.attention_mask[index]
        width = int(mask.sum(1).max())
        return self.input_ids[index, :width], self.labels[index, :width], mask[:, :width]

    __getitem__ = rows  # a training batch (fedfusion.train.loop.train_steps)



# -- formatting ---------------------------------------------------------------------------------------
def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The text a model continues to answer ``prompt``: the chat template's user turn plus generation
    prompt, or the documented fallback."""
    if tokenizer.chat_template:
        return as_text(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True), "apply_chat_template")
    return FALLBACK_PROMPT.format(prompt=prompt)


def encode_pair(tokenizer: PreTrainedTokenizerBase, pair: Pair, max_len: int) -> tuple[list[int], list[int]] | None:
    """(input ids, labels) of one pair, labels -100 outside the response; None if truncation to ``max_len``
    leaves no response token."""
    prompt_ids = _ids(tokenizer, prompt_text(tokenizer, pair.prompt))
    if tokenizer.chat_template:
        full = as_text(tokenizer.apply_chat_template(
            [{"role": "user", "content": pair.prompt}, {"role": "assistant", "content": pair.response}],
            tokenize=False), "apply_chat_template")
        full_ids = _ids(tokenizer, full)
    else:
        full_ids = prompt_ids + _ids(tokenizer, pair.response)
        if tokenizer.eos_token_id is not None:
            full_ids.append(tokenizer.eos_token_id)
    start = 0
    while start < min(len(prompt_ids), len(full_ids)) and prompt_ids[start] == full_ids[start]:
        start += 1
    full_ids = full_ids[:max_len]
    if start >= len(full_ids):
        return None
    return full_ids, [IGNORE] * start + full_ids[start:]


def encode_pairs(tokenizer: PreTrainedTokenizerBase, pairs: list[Pair] | tuple[Pair, ...], max_len: int) -> InstructData:
    """Encode ``pairs`` and right-pad them to the longest kept sequence (pad id from the tokenizer)."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to pad with")
    encoded = [e for e in (encode_pair(tokenizer, p, max_len) for p in pairs) if e is not None]
    if not encoded:
        raise ValueError(f"no pair keeps a response token within max_len={max_len}")
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(ids)] = 1
    return InstructData(input_ids, labels, mask, dropped=len(pairs) - len(encoded))


# -- training and evaluation --------------------------------------------------------------------------
def response_loss(model: PreTrainedModel | PeftModel, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                  reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy on response tokens only; also the shifted logits and labels."""
    ids, labels, mask = ids.to(model.device), labels.to(model.device), mask.to(model.device)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=IGNORE, reduction=reduction)
    return loss, logits, target


@dataclass(frozen=True)
class ResponseLoss:
    """The response-only loss, a plug-in of :func:`fedfusion.train.loop.train_steps` on :class:`InstructData`
    (:func:`response_loss`); a step's tokens are its batch's real (unpadded) tokens."""

    what: str = "training"

    def __call__(self, model: PreTrainedModel | PeftModel, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 rows: torch.Tensor) -> Step:
        ids, labels, mask = batch
        loss, _, _ = response_loss(model, ids, labels, mask)
        return Step(loss, int(mask.sum()))


RESPONSE = ResponseLoss()


@torch.no_grad()
def evaluate_instruct(model: PreTrainedModel, data: InstructData, batch_size: int = 16) -> dict[str, float]:
    """Mean loss, perplexity and next-token accuracy over every response token of ``data``."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(data), batch_size):
        ids, labels, mask = data.rows(torch.arange(i, min(i + batch_size, len(data))))
        loss, logits, target = response_loss(model, ids, labels, mask, reduction="sum")
        scored = target != IGNORE
        loss_sum += loss.item()
        correct += int(((logits.argmax(-1) == target) & scored).sum())
        count += int(scored.sum())
    mean = loss_sum / count
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)), "eval_acc": correct / count}


@torch.no_grad()
def generate_responses(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                       max_new_tokens: int = 40) -> list[str]:
    """Greedy answers to ``prompts`` (formatted as in training), for the report."""
    model.eval()
    answers = []
    for prompt in prompts:
        ids = torch.tensor([_ids(tokenizer, prompt_text(tokenizer, prompt))])
        out = generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                       do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers.append(as_text(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), "decode").strip())
    return answers
