'use strict';
// The Node.js client's request/response roundtrip through the broker, for `make bench`:
//
//   node benchmarks/node_driver.js BROKER AGENT
//
// Reads one line per measurement from stdin, "WARMUP COUNT IN_FLIGHT": makes WARMUP requests
// to AGENT, IN_FLIGHT at a time (V8 counts calls, not how far apart they come), prints
// "warm", waits for a line "go", makes COUNT more, each timed, and prints one JSON line
// {"samples": [seconds, ...]}. Between "warm" and the samples the harness reads the CPU the
// processes spend. Ends at the end of stdin.

const readline = require('node:readline');
const { performance } = require('node:perf_hooks');
const { MeshClient } = require('../clients/node/lib/mesh');

const PAYLOAD = { action: 'process_payment', parameters: { flight: 'Flight A', amount: 450 } };

async function main() {
  const [broker, agent] = process.argv.slice(2);
  const client = new MeshClient(broker, { agentId: 'node-driver' });
  const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
  const ask = async () => {
    const answer = await client.request(agent, PAYLOAD, { timeoutMs: 10000 });
    if (answer.type !== 'RESPONSE') throw new Error(`${agent} answered ${answer.type}`);
  };
  console.log('node driver ready');
  for (;;) {
    const { value, done } = await lines.next();
    if (done) break;
    const [warmup, count, inFlight = 1] = value.trim().split(/\s+/).map(Number);
    let left = warmup;
    const worker = async () => {
      while (left > 0) {
        left -= 1;
        await ask();
      }
    };
    await Promise.all(Array.from({ length: Math.min(inFlight, warmup) }, worker));
    console.log('warm');
    await lines.next(); // "go"
    const samples = [];
    for (let i = 0; i < count; i += 1) {
      const started = performance.now();
      await ask();
      samples.push((performance.now() - started) / 1000);
    }
    console.log(JSON.stringify({ samples }));
  }
  client.close();
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
