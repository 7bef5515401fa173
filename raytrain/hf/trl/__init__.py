"""TRL's SFT, DPO, GRPO and RLOO methods on raytrain's Trainer (raytrain.trl puts them together); imports trl,
whose version is checked first: raytrain binds TRL 1.16's private methods."""

from ...deps import require

require("trl", "raytrain.trl")
