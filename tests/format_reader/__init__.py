"""A sprawl patch reader written only from docs/FORMAT.md, kept apart from the codec it checks."""
