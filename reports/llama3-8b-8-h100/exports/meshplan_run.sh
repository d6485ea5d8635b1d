# meshplan's executor (written by meshplan): the same plan.json on every node
meshplan run --plan plan.json --model llama3-8b --steps 10 --nproc 8

# or torchrun directly (what meshplan run launches)
torchrun --nproc-per-node 8 --standalone -m executor.train --plan plan.json --model llama3-8b --steps 10 --out measured.json
