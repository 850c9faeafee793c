// Runs programs of client calls with the Node.js client (clients/node), one a line of stdin:
// {"address": "127.0.0.1:port", "program": [[kind, ...args], ...]}; writes for each a line of
// what its calls answered, step by step, in the shapes tests/integration/test_node_programs.py
// compares with the Python client's.
'use strict';

const readline = require('node:readline');
const { MeshClient } = require('../../clients/node/lib/mesh.js');

const AGENTS = { a: 'worker', b: 'worker', c: 'auditor' };

function message([to, id, priority], number) {
  return { to, messageId: id, priority, content: { action: 'work', parameters: { n: number } } };
}

function outcome(result) {
  return result.error ? ['refused', result.error.reason] : ['accepted', result.messageId];
}

function refused(error) {
  if (!error.reason) throw error; // not an answer of the broker's: the run fails
  return ['refused', error.reason];
}

function received(m, ids) {
  return [ids.includes(m.messageId) ? m.messageId : m.type, m.from, m.priority, m.content];
}

async function run(address, program, ids) {
  const client = new MeshClient(address, { agentId: 'sender', retryDelaysMs: [] });
  const seen = [];
  try {
    for (const [id, type] of Object.entries(AGENTS)) {
      await client.register({ agentId: id, agentTypes: [type] });
    }
    await client.register({ agentId: 'sender', agentTypes: ['sender'] });
    for (const [number, [kind, ...args]] of program.entries()) {
      if (kind === 'send') {
        const m = message(args[0], number);
        seen.push(await client.send(m.to, m.content, m).then(outcome, refused));
      } else if (kind === 'parallel') { // written together: one batch frame on the session
        seen.push(await Promise.all(args[0].map((one) => {
          const m = message(one, number);
          return client.send(m.to, m.content, m).then(outcome, refused);
        })));
      } else if (kind === 'batch') {
        const results = await client.sendBatch(args[0].map((one) => message(one, number)));
        seen.push(results.map(outcome));
      } else if (kind === 'receive') {
        seen.push((await client.receive(args[0], args[1])).map((m) => received(m, ids)));
      } else if (kind === 'stats') {
        const { agents } = await client.queueStats();
        seen.push(agents
          .filter((q) => Number(q.depth) || Number(q.inFlight) || Number(q.deadLetters))
          .map((q) => [q.agentId, q.high, q.medium, q.low, q.inFlight, q.deadLetters].map(
            (v) => (typeof v === 'string' ? v : Number(v))))
          .sort((x, y) => (x[0] < y[0] ? -1 : 1)));
      } else if (kind === 'broadcast') {
        seen.push(await client.broadcast({ action: 'notice', parameters: { n: number } },
          { agentTypes: args[0] }).then((result) => [[...result.recipients].sort(),
          result.failures.map((f) => f.agentId).sort()], refused)); // (refused: no agent took it)
      } else {
        throw new Error(`unknown step ${kind}`);
      }
    }
  } finally {
    client.close();
  }
  return seen;
}

const lines = readline.createInterface({ input: process.stdin });
(async () => {
  for await (const line of lines) {
    const { address, program, ids } = JSON.parse(line);
    process.stdout.write(`${JSON.stringify(await run(address, program, ids))}\n`);
  }
})().catch((error) => {
  process.stderr.write(`${error.stack}\n`);
  process.exit(1);
});
