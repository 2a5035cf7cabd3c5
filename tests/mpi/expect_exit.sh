#!/bin/sh
# expect_exit.sh CODE COMMAND [ARGS...]: runs COMMAND and succeeds only if it exits with CODE
# (CTest can check output and timeouts, not a particular non-zero status).
want=$1
shift
"$@"
rc=$?
echo "expect_exit: '$1' exited with status $rc (expected $want)"
[ "$rc" -eq "$want" ]
