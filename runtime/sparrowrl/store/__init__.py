"""The checkpoint store (a base every K versions and the chain of deltas between them, which is
also what is served) and model weights on disk."""
