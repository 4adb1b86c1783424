"""The Bradley-Terry pairwise loss of ``hybridflow rm`` and the pairwise metrics it reports.

P(chosen ≻ rejected) = σ(r_c − r_r), so the loss is the pairs' mean of −log σ(r_c − r_r − m) (``m``: TRL's per-pair
``margin``, 0 without one) plus TRL's ``center_rewards_coefficient`` · mean((r_c + r_r)²). Stability: experimental.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["bradley_terry_loss", "pairwise_metrics"]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, *, margin: torch.Tensor | None = None,
                       center_rewards_coefficient: float = 0.0) -> torch.Tensor:
    """Mean over pairs of −log σ(r_c − r_r − margin), plus ``center_rewards_coefficient`` · mean((r_c + r_r)²).
    ``chosen``/``rejected``/``margin``: [N] rewards of the pairs' two sides and their margins."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"chosen and rejected rewards must both be [N]; got {tuple(chosen.shape)} and "
                         f"{tuple(rejected.shape)}")
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin.to(difference)
    loss = -F.logsigmoid(difference).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss


def pairwise_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """``accuracy`` (share of pairs with r_c > r_r; a tie counts half, as a coin flip), ``margin`` (mean r_c − r_r),
    ``chosen_reward`` / ``rejected_reward`` (OpenRLHF's names) and ``reward_mean`` / ``reward_std`` over both sides."""
    chosen, rejected = chosen.detach().float(), rejected.detach().float()
    wins = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
    both = torch.cat([chosen, rejected])
    return {"accuracy": float(wins.mean()), "margin": float((chosen - rejected).mean()),
            "chosen_reward": float(chosen.mean()), "rejected_reward": float(rejected.mean()),
            "reward_mean": float(both.mean()), "reward_std": float(both.std()) if len(both) > 1 else 0.0}
