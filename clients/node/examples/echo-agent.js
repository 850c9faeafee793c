'use strict';
// A Node.js agent in a few lines: `node examples/echo-agent.js AGENT_ID [pull|push]` serves it
// against the broker named by AGENTMESH_BROKER (default 127.0.0.1:50051) until SIGTERM or
// Ctrl-C. It answers every request with what it was sent, and stays in service across broker
// restarts. With `push` the broker calls its server with each message instead of its taking
// them on a session.

const { serveAgent } = require('../lib/mesh');

async function main() {
  const agentId = process.argv[2] || 'NodeEchoAgent';
  const agent = await serveAgent({
    broker: process.env.AGENTMESH_BROKER || '127.0.0.1:50051',
    agentId,
    agentTypes: ['echo'],
    deliveryMode: (process.argv[3] || 'pull').toUpperCase(),
    handler: async (message) => ({ echo: message.content, servedBy: agentId, pid: process.pid }),
  });
  console.log(`${agentId} serving on ${agent.address}`);
  if (agent.healthAddress) console.log(`${agentId} health on ${agent.healthAddress}`);
  const stop = async () => {
    await agent.stop();
    process.exit(0);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
