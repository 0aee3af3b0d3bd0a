"""How sprawl starts: the local stack, stream and consumer declarations, deployment manifests."""
