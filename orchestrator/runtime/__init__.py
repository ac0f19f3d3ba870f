"""Everything that imports torch or megatron.core lives under this package."""
