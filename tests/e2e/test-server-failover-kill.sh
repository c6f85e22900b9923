#!/usr/bin/env bash
# As test-server-failover-drain.sh, with SIGKILL: the agent listing two servers on one
# store moves to the other one with zero errors.
FAILOVER_SIGNAL=KILL exec bash "$(dirname "$0")/test-server-failover-drain.sh"
