"""An episode's tokens and its messages, the same on the worker and the trainer.

The tokens trained are the tokens sampled: an episode is its prompt's ids, then the model's turns
exactly as sampled (each ending at its end-of-turn token), with the environment's turns between
them as tokens appended after that token. Nothing is rendered or tokenized again across turns.

The environment's turn is rendered alone, after a fixed conversation, by the chat template:
everything the template writes after the end-of-turn token of that conversation's assistant
message, through the generation prompt of the model's next turn. A template that renders earlier
turns differently once a later one exists (Qwen3 drops their reasoning) changes only the fixed
conversation's part, which is cut away, never the episode's own tokens: the cut is found by
counting end-of-turn tokens, not by finding the assistant's text, which such a template changes. Without a chat template
an environment's turn is its messages' text, after the model's end-of-turn token.

The trainer reads a worker's episode back (`read`): it renders each of the environment's turns
itself, refuses an episode whose tokens there differ, and decodes the model's turns into the
messages its rubric scores, with the mask of the tokens it trains."""

from __future__ import annotations

from typing import Any

BASE = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


def end_tokens(tok: Any, config_eos: int | list[int] | None) -> set[int]:
    """The tokens a model turn ends at: the tokenizer's EOS and the model config's (some list
    several), as the engines stop at them."""
    return {tok.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])} - {None}


class Turns:
    def __init__(self, tok: Any, templated: bool, eos: set[int]):
        self.tok, self.templated, self.eos = tok, templated, eos

    def tokens(self, messages: list[dict[str, str]], after: int) -> list[int]:
        """The environment's `messages` as the tokens that follow a model turn that ended with
        token `after`. ValueError: the chat template cannot render them so."""
        if not self.templated:
            return list(self.tok("\n".join(m["content"] for m in messages), add_special_tokens=False).input_ids)
        end = self.tok.convert_ids_to_tokens(after)
        try:
            head = self.tok.apply_chat_template(BASE[:1], tokenize=False, add_generation_prompt=True)
            text = self.tok.apply_chat_template(BASE + messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja's errors, and what a template's own raise_exception raises
            raise ValueError(
                f"the chat template refused the environment's messages ({type(e).__name__}: {e})"
            ) from None
        cut = -1
        for _ in range(head.count(end) + 1):  # the fixed assistant message's end: one more than before it
            cut = text.find(end, cut + 1)
            if cut < 0:
                raise ValueError(
                    f"the chat template does not end an assistant message with {end!r}, the turn's last token"
                )
        return list(self.tok(text[cut + len(end) :], add_special_tokens=False).input_ids)

    def text(self, ids: list[int]) -> str:
        """A model turn's text: up to its end-of-turn token, special tokens skipped."""
        end = next((i for i, t in enumerate(ids) if t in self.eos), len(ids))
        return str(self.tok.decode(ids[:end], skip_special_tokens=True))

    def _one_turn(self, span: list[int], k: int) -> None:
        """A model turn ends at its first end-of-turn token: tokens after one would be trained and
        never read by the rubric."""
        if any(t in self.eos for t in span[:-1]):
            raise ValueError(f"the model's turn {k} goes on after its end-of-turn token")

    def read(self, tokens: list[int], episode: dict[str, Any]) -> tuple[list[dict[str, str]], list[bool]]:
        """A worker's episode as the messages after its prompt (the model's, decoded here, and the
        environment's) and the mask of the tokens the model sampled. ValueError: its tokens are
        not what its turns say."""
        messages: list[dict[str, str]] = []
        mask = [True] * len(tokens)
        pos = 0
        for k, turn in enumerate(episode["turns"]):
            at, n = turn["at"], turn["tokens"]
            if not pos < at or at + n > len(tokens):
                raise ValueError(
                    f"the environment's turn {k} at token {at} is not after a model turn within the episode"
                )
            if tokens[at - 1] not in self.eos:
                raise ValueError(f"the environment's turn {k} follows a model turn that did not end")
            self._one_turn(tokens[pos:at], k)
            messages.append({"role": "assistant", "content": self.text(tokens[pos:at])})
            if tokens[at : at + n] != self.tokens(turn["messages"], tokens[at - 1]):
                raise ValueError(f"the environment's turn {k}: its tokens are not its messages'")
            mask[at : at + n] = [False] * n
            messages.extend({"role": m["role"], "content": m["content"]} for m in turn["messages"])
            pos = at + n
        if pos >= len(tokens):
            raise ValueError("the episode ends with the environment's turn, not the model's")
        self._one_turn(tokens[pos:], len(episode["turns"]))
        messages.append({"role": "assistant", "content": self.text(tokens[pos:])})
        return messages, mask
