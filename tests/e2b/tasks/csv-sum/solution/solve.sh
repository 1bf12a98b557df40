#!/bin/bash
# The reference solution: what an agent that solves the task would run.
set -euo pipefail
python3 -c "import csv; print(sum(int(r['amount']) for r in csv.DictReader(open('/app/data.csv'))))" > /app/answer.txt
