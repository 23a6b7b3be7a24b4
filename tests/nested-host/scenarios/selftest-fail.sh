#!/bin/sh
# description: the harness's own check: a failing scenario's reason comes back
# limit: 30
# sets: selftest
. "$NH_LIB"
fail "selftest failure reason"
