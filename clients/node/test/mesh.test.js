'use strict';
// Runs against a real mesh: AGENTMESH_BROKER and AGENTMESH_GATEWAY name its addresses (the
// Python test tests/integration/test_node_client.py starts it and runs these).

const test = require('node:test');
const assert = require('node:assert/strict');
const { MeshClient, GatewayClient, serveAgent } = require('../lib/mesh');

const BROKER = process.env.AGENTMESH_BROKER;
const GATEWAY = process.env.AGENTMESH_GATEWAY;

test('sends and receives messages in priority order', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeFlightAgent' });
  try {
    await client.register({ agentId: 'NodePaymentAgent', agentTypes: ['payment'] });
    const low = await client.send('NodePaymentAgent',
      { action: 'process_payment', parameters: { amount: 450 } }, { priority: 'LOW' });
    const high = await client.send('NodePaymentAgent', { action: 'refund' }, { priority: 'HIGH' });
    assert.deepEqual(low.recipients, ['NodePaymentAgent']);
    const got = await client.receive('NodePaymentAgent');
    assert.deepEqual(got.map((m) => m.messageId), [high.messageId, low.messageId]);
    assert.equal(got[1].from, 'NodeFlightAgent');
    assert.equal(got[1].type, 'REQUEST');
    assert.deepEqual(got[1].content, { action: 'process_payment', parameters: { amount: 450 } });
    await assert.rejects(client.send('NodePaymentAgent', undefined),
      (err) => err.codeName === 'INVALID_ARGUMENT' && err.message === 'content is required');
    await assert.rejects(client.send('Nobody', { action: 'x' }),
      (err) => err.codeName === 'NOT_FOUND');
  } finally {
    await client.deregister('NodePaymentAgent').catch(() => {});
    client.close();
  }
});

test('requests a Python agent and gets the correlated response', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeCaller' });
  try {
    const response = await client.request('IndustryExpertAgent', { action: 'analyze', query: 'q' },
      { correlationId: 'cor_node_1' });
    assert.equal(response.type, 'RESPONSE');
    assert.equal(response.correlationId, 'cor_node_1');
    assert.equal(response.from, 'IndustryExpertAgent');
    assert.equal(response.content.recommendation, 'Buy AAPL');
  } finally {
    client.close();
  }
});

test('a Node agent takes part in a group chat beside the Python agents', async () => {
  const agent = await serveAgent({
    broker: BROKER, agentId: 'NodeExpertAgent', agentTypes: ['stock_expert'],
    handler: async (message) => ({ recommendation: 'Buy AAPL', confidence: 0.75,
      reasoning: `node saw: ${message.content.query}` }),
  });
  const gateway = new GatewayClient(GATEWAY);
  try {
    const lines = [];
    const events = await gateway.groupChat({
      agentIds: ['IndustryExpertAgent', 'TechnicalAnalysisAgent', 'FundamentalAnalysisAgent',
        'NodeExpertAgent'],
      query: 'What stock should I buy?', optionLabel: 'stocks',
    }, (event) => lines.push(`${event.kind} ${event.summary}`));
    for (const line of lines) console.log(line);
    assert.equal(events[0].kind, 'GROUP_CREATED');
    const contributors = events.filter((e) => e.kind === 'CONTRIBUTION').map((e) => e.agentId);
    assert.ok(contributors.includes('NodeExpertAgent'));
    assert.equal(contributors.length, 4);
    const result = events[events.length - 1];
    assert.equal(result.kind, 'RESULT');
    assert.equal(result.data.status, 'COMPLETED');
    assert.equal(result.data.aggregate.recommendation, 'Buy AAPL (unanimous expert consensus)');
    assert.ok(result.data.aggregate.reasoning.includes('node saw: What stock should I buy?'));
  } finally {
    gateway.close();
    await agent.stop();
  }
});
