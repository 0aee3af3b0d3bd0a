"""The container image: building it (`just image`, `python -m infra.image.build`) with podman or docker,
and a Debian base made from Debian's packages (`build_base.sh`) where no registry is reachable."""
