"""The bridge to Hugging Face: transformers', peft's and trl's objects, formats and names, in one place.

Only modules under raytrain.hf import transformers, peft or trl (an import-linter contract), each lazily
or where the user's objects come from there; the rest of raytrain asks this package about models."""
