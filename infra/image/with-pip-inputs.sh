#!/bin/sh
# Runs a command (pip) with the optional inputs a build was given, none of which stays in a layer:
# a pip configuration and a CA bundle as build secrets, a folder of wheels as a build context.
# Without them pip uses its defaults (PyPI, the system's CAs).
set -eu
if [ -s /run/secrets/pip.conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip.conf; fi
if [ -s /run/secrets/ca.crt ]; then export PIP_CERT=/run/secrets/ca.crt; fi
if [ -d /wheels ] && [ -n "$(ls -A /wheels)" ]; then export PIP_FIND_LINKS=/wheels; fi
exec "$@"
