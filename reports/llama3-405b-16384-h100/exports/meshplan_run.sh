# meshplan's executor (written by meshplan): the same plan.json on every node
meshplan run --plan plan.json --model llama3-405b --steps 10 --nproc 8 --nnodes 2048 --node-rank $NODE_RANK --rdzv-endpoint $MASTER_ADDR:29500

# or torchrun directly (what meshplan run launches)
torchrun --nproc-per-node 8 --nnodes 2048 --node-rank $NODE_RANK --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 -m executor.train --plan plan.json --model llama3-405b --steps 10 --out measured.json
