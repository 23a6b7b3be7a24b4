#!/bin/sh
# description: the harness's own check: a scenario that never ends is killed at its limit,
#   with what it started, and reported as timed out (the harness test runs it)
# limit: 5
# sets: selftest
. "$NH_LIB"
step "starting a child and hanging"
sleep 100000 &
sleep 100000
