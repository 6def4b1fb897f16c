"""The demo's toy task: continue a counting pattern for as long as possible.

A prompt is ``k`` consecutive tokens ``s, s+1, ..., s+k-1`` (mod ``modulus``, offset by
``first_token``). The correct continuation keeps counting. The episode ends at the first wrong token
(the environment stops the sequence there, as a tool or a verifier would) or at the length cap.
Reward = number of correct tokens. The better the policy, the longer its responses: with per-token
accuracy q the mean length is about q / (1 - q), so response length grows over training the way it
does in RL reasoning runs, which is what makes a fixed parallel layout wrong later in the run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class CountingTask:
    modulus: int = 16
    """Tokens used by the pattern."""
    first_token: int = 1
    prompt_len: int = 4

    def prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` prompts [n, prompt_len] with random starting points."""
        start = torch.randint(0, self.modulus, (n, 1), generator=generator)
        steps = torch.arange(self.prompt_len).unsqueeze(0)
        return self.first_token + (start + steps) % self.modulus

    def targets(self, prompts: torch.Tensor, length: int) -> torch.Tensor:
        """The correct continuation [n, length] of each prompt."""
        last = prompts[:, -1:] - self.first_token
        steps = torch.arange(1, length + 1).unsqueeze(0)
        return self.first_token + (last + steps) % self.modulus

    def score(self, prompts: torch.Tensor, responses: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Correct tokens per response (float [n]); ``lengths`` counts the generated tokens,
        including the wrong one that ended the episode."""
        tgt = self.targets(prompts, responses.shape[1])
        ok = (responses == tgt).float()
        pos = torch.arange(responses.shape[1]).unsqueeze(0)
        ok = ok * (pos < lengths.unsqueeze(1)).float()
        # number of leading correct tokens
        return torch.cumprod(ok, dim=1).sum(dim=1)

    def supervised_batch(self, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """Prompt + correct continuation [n, prompt_len + length], for a short warm-up."""
        p = self.prompts(n, generator)
        return torch.cat([p, self.targets(p, length)], dim=1)
