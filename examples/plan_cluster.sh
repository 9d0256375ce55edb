#!/usr/bin/env bash
# What would four 1-thread CPUs like this one give on the paper network, over 1 GbE and 10 GbE?
# Calibrates this host's CPU once, saves the profile, and models the rest.
set -euo pipefail
hetconv-plan --devices cpu:1x4 --link 1gbit --save-profiles cpu1.json
hetconv-plan --devices @cpu1.jsonx4 --link 10gbit
