#!/bin/bash
# The task's verifier: 1 in /logs/verifier/reward.txt when /app/answer.txt is right, else 0.
mkdir -p /logs/verifier
if [ "$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)" = "100" ]; then
  echo 1 > /logs/verifier/reward.txt
  echo "PASSED"
else
  echo 0 > /logs/verifier/reward.txt
  echo "FAILED: /app/answer.txt is $(cat /app/answer.txt 2>/dev/null || echo missing)"
  exit 1
fi
