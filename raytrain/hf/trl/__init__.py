"""TRL's SFT and DPO methods on raytrain's Trainer (raytrain.trl puts them together); imports trl."""
