'use strict';
// Runs against a real mesh: AGENTMESH_BROKER and AGENTMESH_GATEWAY name its addresses (the
// Python test tests/integration/test_node_client.py starts one and runs these); without them,
// `npm test` starts `agentmesh up` for the run (scripts/mesh-up.js).

const test = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const {
  MeshClient, GatewayClient, AgentClient, MeshError, Reject, RetryLater, serveAgent, buildMessage,
} = require('../lib/mesh');
const { meshUp } = require('../scripts/mesh-up');

let BROKER;
let GATEWAY;
let mesh;
test.before(async () => {
  mesh = await meshUp();
  ({ broker: BROKER, gateway: GATEWAY } = mesh);
});
test.after(() => mesh && mesh.stop());

/** Checks of an agent's readiness (its health for mesh.v1.AgentService, or service) at its
 * address; until(status) checks every 20 ms until it says status (10 s at most). */
function readinessProbe(address, service = 'mesh.v1.AgentService') {
  const health = require('grpc-health-check');
  const Health = grpc.makeGenericClientConstructor(health.service, 'Health');
  const probe = new Health(address, grpc.credentials.createInsecure());
  const check = () => new Promise((resolve, reject) => {
    probe.Check({ service }, (err, res) => (err ? reject(err) : resolve(res.status)));
  });
  return {
    check,
    async until(status) {
      const deadline = Date.now() + 10000;
      while (await check() !== status && Date.now() < deadline) {
        await new Promise((resolve) => { setTimeout(resolve, 20); });
      }
      return check();
    },
    close: () => probe.close(),
  };
}

test('sends and receives messages in priority order', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeFlightAgent' });
  try {
    await client.register({ agentId: 'NodePaymentAgent', agentTypes: ['payment'] });
    const low = await client.send('NodePaymentAgent',
      { action: 'process_payment', parameters: { amount: 450 } }, { priority: 'LOW' });
    const high = await client.send('NodePaymentAgent', { action: 'refund' }, { priority: 'HIGH' });
    assert.deepEqual(low.recipients, ['NodePaymentAgent']);
    // What the queue holds, in delivery order, looked at and left there (ListMessages).
    const listed = await client.listMessages('NodePaymentAgent');
    assert.deepEqual(listed.map((q) => [q.message.messageId, q.state, q.attempts, q.until]),
      [[high.messageId, 'WAITING', 0, null], [low.messageId, 'WAITING', 0, null]]);
    const ttlMs = Date.parse(listed[0].expiresAt) - Date.parse(listed[0].acceptedAt);
    assert.ok(Math.abs(ttlMs - 3600000) <= 1, `ttl ${ttlMs} ms`); // (the default, an hour)
    await assert.rejects(client.listMessages('Nobody'), (err) => err.codeName === 'NOT_FOUND');
    const got = await client.receive('NodePaymentAgent');
    assert.deepEqual(got.map((m) => m.messageId), [high.messageId, low.messageId]);
    assert.equal(got[1].from, 'NodeFlightAgent');
    assert.equal(got[1].type, 'REQUEST');
    assert.deepEqual(got[1].content, { action: 'process_payment', parameters: { amount: 450 } });
    await assert.rejects(client.send('NodePaymentAgent', undefined),
      (err) => err.codeName === 'INVALID_ARGUMENT' && err.message === 'content is required'
        && err.reason === 'VALIDATION_FAILED' && err.fieldViolations[0].field === 'content');
    await assert.rejects(client.send('Nobody', { action: 'x' }),
      (err) => err.codeName === 'NOT_FOUND');
    // To "broadcast", a message is a BROADCAST unless it says otherwise (an alert has no
    // action): every other agent gets a copy.
    const alert = await client.send('broadcast', { alert: 'System maintenance in 10 minutes' });
    assert.ok(alert.recipients.includes('NodePaymentAgent'));
    const [copy] = await client.receive('NodePaymentAgent');
    assert.equal(copy.type, 'BROADCAST');
    assert.equal(copy.messageId, alert.messageId);
  } finally {
    await client.deregister('NodePaymentAgent').catch(() => {});
    client.close();
  }
});

test('a scheduled message (delayMs, deliverAt) waits in the broker until it is due', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeScheduler' });
  try {
    await client.register('NodeReminded');
    const later = await client.send('NodeReminded', { action: 'remind' }, { delayMs: 600 });
    const sent = Date.now();
    assert.ok(Math.abs(Date.parse(later.deliverAt) - (sent + 600)) < 100, later.deliverAt);
    const now = await client.send('NodeReminded', { action: 'pay' });
    assert.equal(now.deliverAt, null);
    const listed = await client.listMessages('NodeReminded');
    assert.deepEqual(listed.map((q) => [q.message.content.action, q.state, q.attempts]),
      [['pay', 'WAITING', 0], ['remind', 'DEFERRED', 0]]);
    assert.equal(Date.parse(listed[1].until), Date.parse(later.deliverAt));
    const [stats] = (await client.queueStats('NodeReminded')).agents;
    assert.deepEqual([stats.depth, stats.inFlight, stats.deferred], [1, 0, 1]);
    assert.deepEqual((await client.receive('NodeReminded')).map((m) => m.content.action), ['pay']);
    // A scheduled message taken back before it is due.
    const dropped = await client.send('NodeReminded', { action: 'drop' }, { delayMs: 60000 });
    assert.deepEqual(await client.cancelMessages('NodeReminded', [dropped, 'nope']),
      [dropped.messageId]);
    await assert.rejects(client.cancelMessages('NodeReminded', dropped.messageId), TypeError);
    let got = [];
    while (got.length === 0) {
      await new Promise((resolve) => setTimeout(resolve, 100));
      got = await client.receive('NodeReminded');
    }
    assert.ok(Date.now() - sent >= 500, `due after ${Date.now() - sent} ms`);
    assert.deepEqual(got.map((m) => [m.content.action, m.deliverAt]), [['remind', later.deliverAt]]);
    assert.throws(() => buildMessage({ to: 'x', content: {}, delayMs: 1, deliverAt: new Date() }),
      /deliverAt or delayMs/);
    assert.throws(() => buildMessage({ to: 'x', content: {}, deliverAt: 'soon' }), /deliverAt/);
    await assert.rejects(client.register(42), TypeError); // (an id, or the registration's fields)
    await assert.rejects(
      client.send('NodeReminded', { action: 'remind' }, { delayMs: 10000, ttl: 5 }),
      (err) => err.codeName === 'INVALID_ARGUMENT' && err.fieldViolations[0].field === 'deliver_at');
  } finally {
    await client.deregister('NodeReminded').catch(() => {});
    client.close();
  }
});

test('an agent names the content fields it requires: a message without one is refused',
  async () => {
    // RF-009 scenario 18: PaymentAgent requires ["action", "parameters"].
    const client = new MeshClient(BROKER, { agentId: 'NodeFieldsSender' });
    const got = [];
    const agent = await serveAgent({ broker: BROKER, agentId: 'NodeFieldsPayment',
      requiredFields: ['action', 'parameters'],
      handler: async (message) => { got.push(message.content); return { status: 'PAID' }; } });
    const direct = new AgentClient(agent.address, { agentId: 'NodeFieldsSender' });
    try {
      const [listed] = (await client.listAgents()).filter(
        (a) => a.agentId === 'NodeFieldsPayment');
      assert.deepEqual(listed.requiredFields, ['action', 'parameters']);
      const paid = await client.request('NodeFieldsPayment',
        { action: 'process_payment', parameters: { amount: 450 } }, { timeoutMs: 10000 });
      assert.equal(paid.content.status, 'PAID');
      await assert.rejects(client.send('NodeFieldsPayment', { action: 'process_payment' }),
        (err) => err.codeName === 'INVALID_ARGUMENT'
          && err.message === 'content.parameters is required by NodeFieldsPayment'
          && err.fieldViolations.map((v) => v.field).join() === 'content.parameters');
      await assert.rejects(client.request('NodeFieldsPayment', { action: 'process_payment' }),
        (err) => err.codeName === 'INVALID_ARGUMENT');
      await assert.rejects(client.register({ agentId: 'NodeFieldsOther', requiredFields: 'x' }),
        (err) => err instanceof TypeError && err.message.startsWith('requiredFields is a list'));
      // Its own server holds a direct call to them too.
      await assert.rejects(direct.handle('NodeFieldsPayment', { action: 'process_payment' }),
        (err) => err.codeName === 'INVALID_ARGUMENT'
          && err.message === 'content.parameters is required by NodeFieldsPayment');
      assert.deepEqual(got, [{ action: 'process_payment', parameters: { amount: 450 } }]);
    } finally {
      direct.close();
      await agent.stop();
      await client.deregister('NodeFieldsPayment').catch(() => {});
      client.close();
    }
  });

test('a client given the address of another server is told to check it', async () => {
  // The broker client at the gateway, the gateway client at the broker: gRPC's bare
  // "Method not found!" was all either said.
  const client = new MeshClient(GATEWAY, { agentId: 'NodeMixedUp' });
  const gateway = new GatewayClient(BROKER);
  try {
    const told = (err) => err instanceof MeshError && err.codeName === 'UNIMPLEMENTED'
      && err.message.startsWith('Method not found!: the server at this address does not')
      && err.message.includes('is it the right address?');
    await assert.rejects(client.listAgents(), told);
    await assert.rejects(gateway.route({ requestType: 'refund_request' }), told);
  } finally {
    client.close();
    gateway.close();
  }
});

test('sends a batch in one call: each message goes in or is refused on its own', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeBatcher' });
  try {
    await client.register({ agentId: 'NodeBatchDesk' });
    const before = (await client.queueStats()).totals;
    const results = await client.sendBatch([
      { to: 'NodeBatchDesk', content: { action: 'late' }, priority: 'LOW' },
      { to: 'NodeBatchDesk' }, // no content
      { to: 'Nobody', content: { action: 'x' } },
      { to: 'NodeBatchDesk', content: { action: 'urgent' }, priority: 'HIGH', ttl: 60 },
    ]);
    assert.equal(results.length, 4);
    assert.equal(results[0].error, undefined);
    assert.equal(results[1].error.codeName, 'INVALID_ARGUMENT');
    assert.equal(results[1].error.reason, 'VALIDATION_FAILED');
    assert.equal(results[2].error.codeName, 'NOT_FOUND');
    assert.equal(results[3].error, undefined);
    const [desk] = (await client.queueStats('NodeBatchDesk')).agents;
    assert.deepEqual(desk, { agentId: 'NodeBatchDesk', depth: 2, high: 1, medium: 0, low: 1,
      inFlight: 0, deadLetters: 0, subscribers: 0, deferred: 0 });
    const after = (await client.queueStats()).totals;
    assert.equal(after.maxMessagesPerAgent, 1000);
    assert.ok(after.sentCount >= before.sentCount + 2);
    assert.ok(after.validationErrors >= before.validationErrors + 1);
    const got = await client.receive('NodeBatchDesk');
    assert.deepEqual(got.map((m) => m.messageId), [results[3].messageId, results[0].messageId]);
    assert.deepEqual(got.map((m) => m.content.action), ['urgent', 'late']);
  } finally {
    await client.deregister('NodeBatchDesk').catch(() => {});
    client.close();
  }
});

test('a send refused by a full queue is tried again (RT-011 backoff) and goes in once',
  async () => {
    const client = new MeshClient(BROKER, { agentId: 'NodeFiller' });
    const retried = [];
    const patient = new MeshClient(BROKER, { agentId: 'NodeRetrier',
      onRetry: (retry) => retried.push(retry) });
    const briefly = [];
    const brief = new MeshClient(BROKER, { agentId: 'NodeRetrier', retryDelaysMs: [10, 10],
      onRetry: (retry) => briefly.push(retry.delayMs) });
    try {
      await client.register({ agentId: 'NodeBusyDesk' });
      const fill = await client.sendBatch(Array.from({ length: 1000 },
        (_, i) => ({ to: 'NodeBusyDesk', content: { action: 'fill', parameters: { i } } })));
      assert.ok(fill.every((r) => !r.error));
      // Two quick retries, both refused: the error comes back, the retries counted.
      await assert.rejects(brief.send('NodeBusyDesk', { action: 'late' }),
        (err) => err.reason === 'QUEUE_FULL');
      assert.deepEqual(brief.stats.retries, { RESOURCE_EXHAUSTED: 2 });
      // The broker's refusal asks for 100 ms (its RetryInfo): longer than 10, so heeded.
      assert.deepEqual(briefly, [100, 100]);
      // RT-011's schedule (100, 500, 2000 ms): room made meanwhile lets it in.
      const pending = patient.send('NodeBusyDesk', { action: 'late' });
      await new Promise((resolve) => { setTimeout(resolve, 150); });
      assert.equal((await client.receive('NodeBusyDesk', 10)).length, 10);
      const sent = await pending;
      assert.ok(retried.length >= 1);
      assert.deepEqual(retried.map((r) => r.delayMs), [100, 500].slice(0, retried.length));
      assert.ok(retried.every((r) => r.code === 'RESOURCE_EXHAUSTED'));
      assert.equal(patient.stats.retries.RESOURCE_EXHAUSTED, retried.length);
      const rest = await client.receive('NodeBusyDesk');
      assert.equal(rest.length, 991);
      assert.deepEqual(rest.filter((m) => m.messageId === sent.messageId).length, 1);
    } finally {
      await client.receive('NodeBusyDesk').catch(() => {});
      await client.deregister('NodeBusyDesk').catch(() => {});
      for (const c of [client, patient, brief]) c.close();
    }
  });

test('a Node agent acknowledges receipt when asked, before it answers (RF-009 ACK)',
  async () => {
    const agent = await serveAgent({
      broker: BROKER,
      agentId: 'NodeFlightDesk',
      handler: async () => {
        await new Promise((resolve) => { setTimeout(resolve, 300); });
        return { booked: true };
      },
    });
    const client = new MeshClient(BROKER, { agentId: 'NodeOrchestrator' });
    try {
      await client.register();
      const sent = await client.send('NodeFlightDesk', { action: 'book_flight' },
        { ackRequired: true });
      const got = [];
      for (let i = 0; i < 200 && got.length < 2; i += 1) {
        got.push(...await client.receive());
        await new Promise((resolve) => { setTimeout(resolve, 20); });
      }
      assert.deepEqual(got.map((m) => m.type), ['ACK', 'RESPONSE']);
      const [ack, response] = got;
      assert.equal(ack.correlationId, sent.messageId);
      assert.equal(ack.from, 'NodeFlightDesk');
      assert.equal(ack.to, 'NodeOrchestrator');
      assert.equal(ack.content.acknowledged_message_id, sent.messageId);
      assert.equal(response.correlationId, sent.messageId);
      assert.equal(response.content.booked, true);
    } finally {
      await agent.stop();
      await client.deregister().catch(() => {});
      client.close();
    }
  });

test('calls an agent directly on its own server, Node or Python (RT-011 peer-to-peer)',
  async () => {
    const agent = await serveAgent({ broker: BROKER, agentId: 'NodePeerAgent',
      agentTypes: ['peer'], capabilities: ['quote'], description: 'Quotes prices',
      actions: ['get_quote'],
      handler: async (message) => ({ count: 42, name: 'Quote desk', list: [1, 2] }[
        message.content.action] ?? { quote: 42, asked: message.content.action }) });
    const client = new MeshClient(BROKER, { agentId: 'NodeCaller' });
    const direct = new AgentClient(agent.address, { agentId: 'NodeCaller' });
    let python = null;
    try {
      const card = await direct.describe();
      assert.equal(card.agentId, 'NodePeerAgent');
      assert.deepEqual(card.agentTypes, ['peer']);
      assert.deepEqual(card.capabilities, ['quote']);
      assert.equal(card.description, 'Quotes prices');
      assert.deepEqual(card.actions, ['get_quote']);
      const answer = await direct.handle('NodePeerAgent', { action: 'get_quote' });
      assert.equal(answer.type, 'RESPONSE');
      assert.deepEqual(answer.content, { action: 'get_quote', quote: 42, asked: 'get_quote' });
      // Any other JSON value comes as {result}, as from a Python agent.
      for (const [action, result] of [['count', 42], ['name', 'Quote desk'], ['list', [1, 2]]]) {
        assert.deepEqual((await direct.handle('NodePeerAgent', { action })).content,
          { action, result });
      }
      const [price] = (await client.listAgents()).filter((a) => a.agentId === 'PriceAgent');
      python = new AgentClient(price.address, { agentId: 'NodeCaller' });
      assert.equal((await python.describe()).agentId, 'PriceAgent');
      const scored = await python.handle('PriceAgent',
        { action: 'score', query: 'Hotel in Paris near Eiffel Tower' });
      assert.equal(scored.type, 'RESPONSE');
      assert.equal(scored.from, 'PriceAgent');
      assert.equal(scored.content.dimension, 'price');
      assert.equal(scored.content.city, 'Paris');
      assert.equal(typeof scored.content.confidence, 'number');
      // A message such as the broker would refuse is refused by either agent's server too,
      // before its handler: the same status, reason and fields.
      for (const [peer, agentId] of [[direct, 'NodePeerAgent'], [python, 'PriceAgent']]) {
        await assert.rejects(peer.handle('NodeLedger', { action: 'get_quote' }),
          (err) => err.codeName === 'INVALID_ARGUMENT' && err.reason === 'VALIDATION_FAILED'
            && err.message === `this server serves ${agentId}, not NodeLedger`
            && err.fieldViolations.map((v) => v.field).join() === 'to_agent');
        for (const [message, fields] of [
          [{ from_agent: 'NodeCaller', to_agent: agentId }, 'content'],
          [{ from_agent: 'NodeCaller', to_agent: agentId, content: { fields: {} } },
            'content.action'],
          [{}, 'from_agent,to_agent,content'],
        ]) {
          await assert.rejects(new Promise((resolve, reject) => {
            peer.agent.HandleMessage({ message }, new grpc.Metadata(),
              (err, res) => (err ? reject(new MeshError(err)) : resolve(res)));
          }), (err) => err.codeName === 'INVALID_ARGUMENT'
            && err.fieldViolations.map((v) => v.field).join() === fields);
        }
      }
    } finally {
      if (python) python.close();
      direct.close();
      client.close();
      await agent.stop();
    }
  });

test('a plain gRPC server registered for push is called by the broker with each message',
  async () => {
    const protoLoader = require('@grpc/proto-loader');
    const { PROTO_ROOT } = require('../lib/mesh');
    const { v1 } = grpc.loadPackageDefinition(protoLoader.loadSync('mesh/v1/agent.proto',
      { includeDirs: [PROTO_ROOT], keepCase: true, enums: String, defaults: true })).mesh;
    const seen = [];
    const server = new grpc.Server();
    server.addService(v1.AgentService.service, {
      HandleMessage({ request }, callback) {
        seen.push(request.message);
        callback(null, { response: { message_type: 'MESSAGE_TYPE_RESPONSE', content: { fields: {
          action: { stringValue: 'quote' }, price: { numberValue: 42 } } } } });
      },
      DescribeAgent(_, callback) { callback(null, { card: { agent_id: 'NodePushDesk' } }); },
    });
    const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0',
      grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))));
    const address = `127.0.0.1:${port}`;
    const client = new MeshClient(BROKER, { agentId: 'NodeBuyer' });
    try {
      await assert.rejects(client.register({ agentId: 'NodePushDesk', address,
        deliveryMode: 'SIDEWAYS' }), TypeError);
      await assert.rejects(client.register({ agentId: 'NodePushDesk', deliveryMode: 'PUSH' }),
        (err) => err.codeName === 'INVALID_ARGUMENT'
          && err.fieldViolations[0].field === 'agent.address');
      await assert.rejects(client.register({ agentId: 'NodePushDesk', address,
        deliveryMode: 'PUSH', maxInFlight: -1 }), TypeError);
      const info = await client.register({ agentId: 'NodePushDesk', address,
        deliveryMode: 'PUSH', maxInFlight: 4 });
      assert.equal(info.deliveryMode, 'PUSH');
      assert.equal(info.maxInFlight, 4);
      const answer = await client.request('NodePushDesk', { action: 'quote', item: 'tea' });
      assert.equal(answer.type, 'RESPONSE');
      assert.equal(answer.from, 'NodePushDesk');
      assert.deepEqual(answer.content, { action: 'quote', price: 42 });
      assert.equal(seen.length, 1);
      assert.equal(seen[0].to_agent, 'NodePushDesk');
      assert.equal(answer.correlationId, seen[0].message_id);
      const [listed] = (await client.listAgents()).filter((a) => a.agentId === 'NodePushDesk');
      assert.equal(listed.deliveryMode, 'PUSH');
      assert.deepEqual(listed.pushInstances, [address]);
    } finally {
      await client.deregister('NodePushDesk').catch(() => {});
      client.close();
      server.forceShutdown();
    }
  });

test('a Node agent served for push answers the broker\'s calls, with no session of its own',
  async () => {
    await assert.rejects(serveAgent({ broker: BROKER, agentId: 'NodePushed',
      deliveryMode: 'SIDEWAYS', handler: async () => ({}) }), TypeError);
    const agent = await serveAgent({ broker: BROKER, agentId: 'NodePushed',
      deliveryMode: 'PUSH', handler: async (message) => ({ doubled: message.content.n * 2 }) });
    const client = new MeshClient(BROKER, { agentId: 'NodePushCaller' });
    try {
      const answer = await client.request('NodePushed', { action: 'double', n: 21 });
      assert.equal(answer.type, 'RESPONSE');
      assert.equal(answer.from, 'NodePushed');
      assert.deepEqual(answer.content, { action: 'double', doubled: 42 });
      const [listed] = (await client.listAgents()).filter((a) => a.agentId === 'NodePushed');
      assert.equal(listed.deliveryMode, 'PUSH');
      const { agents } = await client.queueStats('NodePushed');
      assert.equal(agents[0].subscribers, 1); // the broker's push, no session of the agent's
    } finally {
      await agent.stop();
      client.close();
    }
  });

test('a Node agent says NOT_SERVING as it stops, and finishes what it was handling',
  async () => {
    let release;
    const released = new Promise((resolve) => { release = resolve; });
    let started;
    const handling = new Promise((resolve) => { started = resolve; });
    const agent = await serveAgent({ broker: BROKER, agentId: 'NodeStoppingAgent',
      handler: async () => { started(); await released; return { finished: true }; } });
    const probe = readinessProbe(agent.address);
    const { check } = probe;
    const client = new MeshClient(BROKER, { agentId: 'NodeStopCaller' });
    try {
      assert.equal(await check(), 'SERVING');
      const answer = client.request('NodeStoppingAgent', { action: 'work' }, { timeoutMs: 10000 });
      await handling;
      const stopping = agent.stop(10000);
      assert.equal(await check(), 'NOT_SERVING');
      release();
      assert.equal((await answer).content.finished, true);
      await stopping;
    } finally {
      release();
      probe.close();
      client.close();
      await agent.stop(); // (whatever failed above: a server left running holds the process)
    }
  });

test('a process serving several Node agents is ready while every one takes its messages',
  async () => {
    // agentmesh.agents, on each agent's server: what a pod's readiness probe asks.
    const first = await serveAgent({ broker: BROKER, agentId: 'NodeDeskA',
      handler: async () => ({ desk: 'A' }) });
    const second = await serveAgent({ broker: BROKER, agentId: 'NodeDeskB',
      handler: async () => ({ desk: 'B' }) });
    const pod = readinessProbe(first.address, 'agentmesh.agents');
    const secondsProcess = readinessProbe(second.address, 'agentmesh.agents');
    const own = readinessProbe(first.address);
    const client = new MeshClient(BROKER, { agentId: 'NodeDeskAdmin' });
    const warn = console.warn;
    console.warn = () => {}; // (NodeDeskB says it was deregistered)
    try {
      assert.equal(await pod.check(), 'SERVING');
      assert.equal(await secondsProcess.check(), 'SERVING');
      await client.deregister('NodeDeskB'); // it takes no more messages: the process is not ready
      assert.equal(await pod.until('NOT_SERVING'), 'NOT_SERVING');
      assert.equal(await own.check(), 'SERVING'); // (NodeDeskA itself still takes them)
      const answer = await client.request('NodeDeskA', { action: 'ask' }, { timeoutMs: 10000 });
      assert.equal(answer.content.desk, 'A');
      await second.stop(); // no longer one of the process's agents
      assert.equal(await pod.until('SERVING'), 'SERVING');
    } finally {
      console.warn = warn;
      for (const probe of [pod, secondsProcess, own]) probe.close();
      client.close();
      await second.stop();
      await first.stop();
    }
  });

test('a deregistered Node agent stops taking messages and does not register itself again',
  async () => {
    const agent = await serveAgent({ broker: BROKER, agentId: 'NodeDeregisteredAgent',
      handler: async () => ({ paid: true }) });
    const probe = readinessProbe(agent.address);
    const client = new MeshClient(BROKER, { agentId: 'NodeDeregistering' });
    const warned = [];
    const warn = console.warn;
    console.warn = (line) => { warned.push(line); };
    // A session of a client's own on another agent: the broker ends it, and says why.
    await client.register({ agentId: 'NodeEndedDesk' });
    const session = client.session(async () => null, { agentId: 'NodeEndedDesk' });
    const sessionEnded = new Promise((resolve) => { session.on('error', resolve); });
    await new Promise((resolve) => { session.on('subscribed', resolve); });
    try {
      const paid = await client.request('NodeDeregisteredAgent', { action: 'pay' },
        { timeoutMs: 10000 });
      assert.equal(paid.content.paid, true);
      await client.deregister('NodeDeregisteredAgent');
      await client.deregister('NodeEndedDesk');
      const ended = await sessionEnded;
      assert.equal(ended.codeName, 'NOT_FOUND');
      assert.equal(ended.reason, 'AGENT_DEREGISTERED');
      assert.equal(ended.message, 'agent NodeEndedDesk was deregistered: its subscription ended');
      assert.equal(await probe.until('NOT_SERVING'), 'NOT_SERVING');
      // Past its first delay before registering and subscribing again: still off the mesh.
      await new Promise((resolve) => { setTimeout(resolve, 1000); });
      const ids = (await client.listAgents()).map((a) => a.agentId);
      assert.ok(!ids.includes('NodeDeregisteredAgent'), ids.join());
      await assert.rejects(client.send('NodeDeregisteredAgent', { action: 'pay' }),
        (err) => err.codeName === 'NOT_FOUND');
      assert.deepEqual(warned, ['NodeDeregisteredAgent was deregistered: it takes no more '
        + 'messages (start it again to register it again)']);
    } finally {
      console.warn = warn;
      probe.close();
      client.close();
      await agent.stop();
    }
  });

test('two Node processes serve one agent id: one stopping leaves the agent to the other',
  async () => {
    const first = await serveAgent({ broker: BROKER, agentId: 'NodeTwinAgent',
      handler: async () => ({ by: 'first' }) });
    const second = await serveAgent({ broker: BROKER, agentId: 'NodeTwinAgent',
      handler: async () => ({ by: 'second' }) });
    const client = new MeshClient(BROKER, { agentId: 'NodeTwinCaller' });
    const running = new Set([first, second]);
    const stop = async (agent) => { running.delete(agent); await agent.stop(); };
    try {
      const [card] = (await client.listAgents()).filter((a) => a.agentId === 'NodeTwinAgent');
      assert.deepEqual(card.instances, [first.address, second.address]);
      await stop(first);
      const [left] = (await client.listAgents()).filter((a) => a.agentId === 'NodeTwinAgent');
      assert.deepEqual(left.instances, [second.address]);
      const answer = await client.request('NodeTwinAgent', { action: 'work' }, { timeoutMs: 5000 });
      assert.equal(answer.content.by, 'second');
      await Promise.all([stop(second), second.stop()]); // a second call waits for the first
      assert.ok(!(await client.listAgents()).some((a) => a.agentId === 'NodeTwinAgent'));
    } finally {
      client.close();
      await Promise.all([...running].map((agent) => agent.stop()));
    }
  });

test('a Node agent hears when the broker refuses its answer, instead of losing it silently',
  async () => {
    const refused = [];
    const agent = await serveAgent({ broker: BROKER, agentId: 'NodeLonelyAgent',
      handler: async () => ({ done: true }), onRefused: (err) => refused.push(err) });
    const ghost = new MeshClient(BROKER, { agentId: 'NodeGhostCaller' }); // never registered
    try {
      await ghost.send('NodeLonelyAgent', { action: 'work' }, { ackRequired: true });
      for (let i = 0; i < 100 && refused.length < 1; i += 1) {
        await new Promise((resolve) => { setTimeout(resolve, 20); });
      }
      await new Promise((resolve) => { setTimeout(resolve, 200); });
      // Its RESPONSE to a sender that is not registered (the ACK of receipt is the broker's:
      // its failure is the broker's to log, not the agent's to hear).
      assert.equal(refused.length, 1);
      assert.ok(refused.every((err) => err.codeName === 'NOT_FOUND'
        && err.reason === 'AGENT_NOT_FOUND' && /NodeGhostCaller/.test(err.message)));
    } finally {
      ghost.close();
      await agent.stop();
    }
  });

test('a plain subscription acknowledges receipt when asked, too', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodePlainOrchestrator' });
  const desk = new MeshClient(BROKER, { agentId: 'NodePlainDesk' });
  let stream = null;
  try {
    await client.register();
    await desk.register();
    const handled = [];
    stream = desk.subscribe(async (message) => { handled.push(message.messageId); });
    const sent = await client.send('NodePlainDesk', { action: 'book' }, { ackRequired: true });
    let acks = [];
    for (let i = 0; i < 100 && acks.length === 0; i += 1) {
      await new Promise((resolve) => { setTimeout(resolve, 20); });
      acks = await client.receive();
    }
    assert.equal(acks.length, 1);
    assert.equal(acks[0].type, 'ACK');
    assert.equal(acks[0].correlationId, sent.messageId);
    assert.equal(acks[0].from, 'NodePlainDesk');
    assert.deepEqual(handled, [sent.messageId]);
  } finally {
    if (stream) stream.cancel();
    await desk.deregister().catch(() => {});
    await client.deregister().catch(() => {});
    desk.close();
    client.close();
  }
});

test('a subscription naming its instance takes it off the agent when it is lost',
  async () => {
    const desk = new MeshClient(BROKER, { agentId: 'NodeLostDesk' });
    const address = '10.7.7.7:7000';
    const instances = async () => {
      const [card] = (await desk.listAgents()).filter((a) => a.agentId === 'NodeLostDesk');
      return card;
    };
    try {
      await desk.register({ address });
      const handled = [];
      const stream = desk.subscribe(async (m) => { handled.push(m.messageId); },
        { instance: address });
      await desk.send('NodeLostDesk', { action: 'ping' }); // delivered: the subscription is on
      for (let i = 0; i < 200 && handled.length === 0; i += 1) {
        await new Promise((resolve) => { setTimeout(resolve, 20); });
      }
      assert.equal(handled.length, 1);
      assert.deepEqual((await instances()).instances, [address]);
      stream.cancel(); // as a process that dies loses its stream
      let card = await instances();
      for (let i = 0; i < 200 && card.instances.length > 0; i += 1) {
        await new Promise((resolve) => { setTimeout(resolve, 20); });
        card = await instances();
      }
      assert.deepEqual(card.instances, []);
      assert.equal(card.address, '');
      assert.ok(!Number.isNaN(Date.parse(card.lostAt)), card.lostAt);
    } finally {
      await desk.deregister().catch(() => {});
      desk.close();
    }
  });

test('broadcasts to the agents of a type, and says whose queue could not take a copy',
  async () => {
    const client = new MeshClient(BROKER, { agentId: 'NodeWarehouse' });
    const shops = ['NodeShopA', 'NodeShopB'];
    try {
      for (const agentId of shops) await client.register({ agentId, agentTypes: ['node_shop'] });
      const sent = await client.broadcast({ action: 'restock', parameters: { sku: 'A-1' } },
        { agentTypes: ['node_shop'] });
      assert.deepEqual([...sent.recipients].sort(), shops);
      assert.deepEqual(sent.failures, []);
      for (const agentId of shops) {
        const [copy] = await client.receive(agentId);
        assert.equal(copy.messageId, sent.messageId);
        assert.equal(copy.type, 'BROADCAST');
        assert.equal(copy.to, agentId);
        assert.deepEqual(copy.content, { action: 'restock', parameters: { sku: 'A-1' } });
      }
      // NodeShopB's queue full (1000 messages): its copy is refused, NodeShopA's goes in.
      for (let i = 0; i < 10; i += 1) {
        await Promise.all(Array.from({ length: 100 },
          () => client.send('NodeShopB', { action: 'fill' }, { priority: 'HIGH' })));
      }
      // A full queue says so, and when to try again: on the session and in a batch.
      const impatient = new MeshClient(BROKER, { agentId: 'NodeWarehouse', retryDelaysMs: [] });
      await assert.rejects(impatient.send('NodeShopB', { action: 'more' }), (err) => {
        assert.equal(err.codeName, 'RESOURCE_EXHAUSTED');
        assert.equal(err.reason, 'QUEUE_FULL');
        assert.ok(err.retryAfterMs > 0, String(err.retryAfterMs));
        return true;
      }).finally(() => impatient.close());
      const [refused] = await client.sendBatch([{ to: 'NodeShopB', content: { action: 'more' } }]);
      assert.equal(refused.error.reason, 'QUEUE_FULL');
      assert.ok(refused.error.retryAfterMs > 0);
      const partial = await client.broadcast({ action: 'restock' }, { agentTypes: ['node_shop'] });
      assert.deepEqual(partial.recipients, ['NodeShopA']);
      assert.equal(partial.failures.length, 1);
      assert.equal(partial.failures[0].agentId, 'NodeShopB');
      assert.equal(partial.failures[0].error.codeName, 'RESOURCE_EXHAUSTED');
      assert.match(partial.failures[0].error.message, /NodeShopB queue full/);
    } finally {
      for (const agentId of shops) {
        await client.receive(agentId).catch(() => {});
        await client.deregister(agentId).catch(() => {});
      }
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

test('requests in flight together on one session each get their own answer', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeBusyCaller' });
  const agent = await serveAgent({ broker: BROKER, agentId: 'NodeDoubler',
    handler: async (message) => ({ doubled: message.content.parameters.n * 2 }) });
  try {
    const answers = await Promise.all(Array.from({ length: 100 },
      (_, n) => client.request('NodeDoubler', { action: 'double', parameters: { n } })));
    assert.deepEqual(answers.map((a) => a.content.doubled),
      Array.from({ length: 100 }, (_, n) => 2 * n));
    const sent = await Promise.all(Array.from({ length: 20 },
      () => client.send('NodeDoubler', { action: 'double', parameters: { n: 1 } },
        { priority: 'HIGH' })));
    assert.equal(new Set(sent.map((m) => m.messageId)).size, 20);
    assert.ok(sent.every((m) => m.recipients[0] === 'NodeDoubler' && m.priority === 'HIGH'));
    await assert.rejects(client.send('NodeDoubler', { action: 'x' }, { type: 'NOTIFICATION' }),
      (err) => err instanceof TypeError && err.message.startsWith('type "NOTIFICATION"'));
    await assert.rejects(client.send('NodeDoubler', { action: 'x' }, { priority: 'URGENT' }),
      TypeError);
  } finally {
    await agent.stop();
    client.close();
  }
});

test('sends written together go out together, in order, never past what a frame may carry',
  async () => {
    const client = new MeshClient(BROKER, { agentId: 'NodeBurstSender' });
    try {
      await client.register({ agentId: 'NodeBurstSink' });
      const sent = await Promise.all(Array.from({ length: 100 },
        (_, i) => client.send('NodeBurstSink', { action: 'record', parameters: { i } })));
      const got = await client.receive('NodeBurstSink');
      assert.deepEqual(got.map((m) => m.messageId), sent.map((m) => m.messageId));
      // Ten of 900 kB at once: 9 MB, more than the broker reads in one frame (8 MiB).
      const big = 'x'.repeat(900 * 1024);
      const large = await Promise.all(Array.from({ length: 10 },
        (_, i) => client.send('NodeBurstSink', { action: 'record', parameters: { i, big } })));
      const taken = [];
      while (taken.length < 10) taken.push(...await client.receive('NodeBurstSink'));
      assert.deepEqual(taken.map((m) => m.messageId), large.map((m) => m.messageId));
      assert.ok(taken.every((m) => m.content.parameters.big.length === big.length));
      assert.deepEqual(client.stats.retries, {}); // (none refused on the way, to be sent again)
    } finally {
      client.close();
    }
  });

test('a request nobody answers ends with DEADLINE_EXCEEDED, and the session goes on', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeImpatient' });
  try {
    await client.register({ agentId: 'NodeSilent' });
    const started = Date.now();
    await assert.rejects(client.request('NodeSilent', { action: 'wait' }, { timeoutMs: 300 }),
      (err) => err.codeName === 'DEADLINE_EXCEEDED');
    assert.ok(Date.now() - started < 1300);
    // Given up, the request is withdrawn from its queue: whoever comes later does not get it.
    assert.deepEqual(await client.receive('NodeSilent'), []);
    const answer = await client.request('IndustryExpertAgent', { action: 'analyze', query: 'q' });
    assert.equal(answer.content.recommendation, 'Buy AAPL');
  } finally {
    await client.deregister('NodeSilent').catch(() => {});
    client.close();
  }
});

test('a Node agent takes a plain broadcast without answering it, and answers a gather',
  async () => {
    const client = new MeshClient(BROKER, { agentId: 'NodeAnnouncer' });
    const seen = [];
    const agent = await serveAgent({ broker: BROKER, agentId: 'NodeListener',
      agentTypes: ['node_listener'],
      handler: async (message) => { seen.push(message.type); return { noted: true }; } });
    try {
      await client.register({ agentId: 'NodeAnnouncer' });
      const sent = await client.broadcast({ alert: 'maintenance at noon' },
        { agentTypes: ['node_listener'] });
      assert.deepEqual(sent.recipients, ['NodeListener']);
      while (seen.length === 0) await new Promise((resolve) => { setTimeout(resolve, 20); });
      await new Promise((resolve) => { setTimeout(resolve, 200); });
      assert.deepEqual(await client.receive('NodeAnnouncer'), []);
      const outcomes = await client.gather({ query: 'status?' }, { agentTypes: ['node_listener'] });
      assert.deepEqual(outcomes.map((o) => [o.agentId, o.response && o.response.content.noted]),
        [['NodeListener', true]]);
      assert.deepEqual(seen, ['BROADCAST', 'BROADCAST']);
    } finally {
      await agent.stop();
      await client.deregister('NodeAnnouncer').catch(() => {});
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

test('hands a task to another agent with its context, read back as message.handoff',
  async () => {
    const client = new MeshClient(BROKER, { agentId: 'NodeSellerAgent' });
    try {
      await client.register({ agentId: 'NodeRefundDesk' });
      const sent = await client.handoff('NodeRefundDesk', 'Process refund for order #12345', {
        context: { order_id: '12345', items: ['lamp'], amount: 99.5 },
        previousResult: { status: 'APPROVED' },
        constraints: { max_amount: 100 },
        workflowId: 'wf_node_1',
        stepNumber: 2,
        priority: 'HIGH',
      });
      assert.equal(sent.type, 'HANDOFF');
      assert.equal(sent.from, 'NodeSellerAgent');
      assert.equal(sent.priority, 'HIGH');
      const [got] = await client.receive('NodeRefundDesk');
      assert.equal(got.messageId, sent.messageId);
      assert.equal(got.content.action, 'execute_handoff');
      assert.deepEqual(got.handoff, {
        taskDescription: 'Process refund for order #12345',
        context: { order_id: '12345', items: ['lamp'], amount: 99.5 },
        previousResult: { status: 'APPROVED' },
        constraints: { max_amount: 100 },
        workflowId: 'wf_node_1',
        stepNumber: 2,
      });
      await assert.rejects(client.handoff('NodeRefundDesk', ''), (err) => {
        assert.equal(err.codeName, 'INVALID_ARGUMENT');
        assert.equal(err.reason, 'HANDOFF_FAILED'); // from the call's google.rpc.Status
        assert.match(err.message, /task_description/);
        return true;
      });
      await assert.rejects(client.receive(''), (err) => {
        assert.equal(err.reason, 'VALIDATION_FAILED');
        assert.deepEqual(err.fieldViolations.map((v) => v.field), ['agent_id']);
        return true;
      });
      await assert.rejects(client.handoff('Nobody', 'Refund'),
        (err) => err.codeName === 'NOT_FOUND' && err.reason === 'AGENT_NOT_FOUND');
      await assert.rejects(client.handoff('NodeRefundDesk', 'Refund', { priority: 'URGENT' }),
        (err) => err instanceof TypeError);
      assert.deepEqual(await client.receive('NodeRefundDesk'), []); // nothing refused went in
      // The desk, last of the workflow, ends it: FAILED at its step (and why), or COMPLETED,
      // over what the hand-off recorded; a workflow no hand-off named has nothing to end.
      const desk = new MeshClient(BROKER, { agentId: 'NodeRefundDesk' });
      try {
        const failed = await desk.endWorkflow('wf_node_1',
          { status: 'FAILED', errorReason: 'Payment failed' });
        assert.equal(failed.updatedBy, 'NodeRefundDesk');
        assert.deepEqual([failed.value.status, failed.value.failed_at_step,
          failed.value.error_reason, failed.value.current_agent, failed.value.step],
        ['FAILED', 2, 'Payment failed', 'NodeRefundDesk', 2]);
        assert.ok(Math.abs(Date.parse(failed.value.finished_at) - Date.now()) < 10000);
        assert.ok(failed.expiresAt !== null); // (the time the status had left, kept)
        const done = await desk.endWorkflow('wf_node_1');
        assert.equal(done.value.status, 'COMPLETED');
        assert.ok(!('failed_at_step' in done.value) && !('error_reason' in done.value));
        assert.equal(done.version, failed.version + 1);
        assert.equal(await desk.endWorkflow('wf_node_never'), null);
        await assert.rejects(desk.endWorkflow('wf_node_1', { status: 'DONE' }), TypeError);
        await assert.rejects(desk.endWorkflow(''), TypeError);
      } finally {
        desk.close();
      }
    } finally {
      await client.deregister('NodeRefundDesk').catch(() => {});
      client.close();
    }
  });

test('a Node agent takes its step in a hand-off workflow after a Python agent', async () => {
  const seen = [];
  const agent = await serveAgent({
    broker: BROKER,
    agentId: 'NodeRefundAgent',
    handler: async (message) => {
      seen.push(message);
      return { status: 'REFUNDED', refund_id: 'r-12345' };
    },
  });
  const gateway = new GatewayClient(GATEWAY);
  try {
    const events = await gateway.handoffWorkflow({
      steps: [{ agentId: 'CustomerAgent' }, { agentId: 'NodeRefundAgent' }],
      task: 'Process refund for order #12345',
      stepTimeout: '5s',
    });
    const result = events[events.length - 1].data;
    assert.equal(result.status, 'COMPLETED');
    assert.equal(result.final_status, 'REFUNDED');
    assert.equal(seen.length, 1);
    const [handed] = seen;
    assert.equal(handed.type, 'HANDOFF');
    assert.equal(handed.from, 'CustomerAgent');
    assert.equal(handed.handoff.taskDescription, 'Approve refund for order 12345');
    assert.equal(handed.handoff.stepNumber, 2);
    assert.equal(handed.handoff.workflowId, events[0].runId);
    assert.equal(handed.handoff.previousResult.order_id, '12345');
  } finally {
    gateway.close();
    await agent.stop();
  }
});

test('tools run under each agent\'s allow-list', async () => {
  const client = new MeshClient(BROKER, { agentId: 'web-search-agent' });
  try {
    const names = (await client.listTools()).map((t) => t.name);
    assert.deepEqual([...names].sort(), ['web_fetch', 'web_search']);
    const hits = await client.callTool('web_search', { query: 'battery recycling', limit: 3 });
    assert.ok(Array.isArray(hits) && hits.length > 0 && hits.length <= 3, JSON.stringify(hits));
    await assert.rejects(client.callTool('web_search', { query: 'x' },
      { agentId: 'synthesis-agent' }),
    (err) => err.codeName === 'PERMISSION_DENIED' && err.reason === 'TOOL_NOT_ALLOWED');
    await assert.rejects(client.callTool('teleport', {}),
      (err) => err.reason === 'UNKNOWN_TOOL' || err.reason === 'TOOL_NOT_ALLOWED');
  } finally {
    client.close();
  }
});

test('runs every gateway pattern from plain objects', async () => {
  const gateway = new GatewayClient(GATEWAY);
  try {
    const refund = await gateway.handoffWorkflow({
      steps: ['CustomerAgent', 'SellerAgent', 'PaymentAgent', 'NotificationAgent']
        .map((agentId) => ({ agentId })),
      task: 'Process refund for order #12347',
      failureAgent: 'NotificationAgent',
      stepTimeout: '5s',
    });
    const failed = refund[refund.length - 1].data;
    assert.equal(failed.status, 'FAILED');
    assert.equal(failed.failed_at_step, 2);
    assert.equal(failed.error_reason, 'Payment failed');

    const hotels = await gateway.collaborativeFiltering({
      agentIds: ['PriceAgent', 'QualityAgent', 'LocationAgent', 'ReviewsAgent'],
      weights: { price: 0.2, quality: 0.4, location: 0.3, reviews: 0.1 },
      query: 'Hotel in Paris near Eiffel Tower',
    });
    const scored = hotels[hotels.length - 1].data;
    assert.equal(scored.status, 'COMPLETED');
    assert.equal(scored.opinions.length, 4);
    assert.ok(scored.recommendation);

    const routed = await gateway.route({ requestType: 'stock_recommendation', query: 'Buy?' });
    assert.equal(routed[0].kind, 'ROUTED');
    assert.equal(routed[routed.length - 1].kind, 'RESULT');

    const both = await gateway.parallel({ patterns: [
      { name: 'hotel', route: { requestType: 'hotel_recommendation' } },
      { name: 'flight', route: { requestType: 'flight_recommendation' } },
    ] });
    assert.equal(both[both.length - 1].data.status, 'COMPLETED');

    const stats = await gateway.patternStats();
    assert.ok(stats.length >= 3);
    const filtering = stats.find((s) => s.pattern === 'COLLABORATIVE_FILTERING');
    assert.ok(filtering.runs >= 1 && filtering.completionRate > 0);

    // The user liked the hotel: the pattern's accuracy counts it.
    const rated = await gateway.recordFeedback(hotels[hotels.length - 1].runId, true);
    assert.equal(rated.pattern, 'COLLABORATIVE_FILTERING');
    assert.equal(rated.stats.pattern, 'COLLABORATIVE_FILTERING');
    assert.equal(rated.stats.rated, 1);
    assert.equal(rated.stats.accuracy, 1);
    await assert.rejects(gateway.recordFeedback('no-such-run', true),
      (err) => err.codeName === 'NOT_FOUND');

    await assert.rejects(gateway.groupChat({ agentIdz: ['PriceAgent'], query: 'q' }),
      (err) => err instanceof TypeError && err.message.includes('no field agentIdz'));
    await assert.rejects(gateway.groupChat({ agentIds: [], query: 'q' }),
      (err) => err.codeName === 'INVALID_ARGUMENT');
  } finally {
    gateway.close();
  }
});

test('a Node agent answers a request it fails with an ERROR, and finishes its work on stop',
  async () => {
    let started;
    const entered = new Promise((resolve) => { started = resolve; });
    const agent = await serveAgent({
      broker: BROKER, agentId: 'NodeCardAgent',
      handler: async (message) => {
        if (message.content.action === 'charge') throw new Error('card declined');
        started();
        await new Promise((resolve) => { setTimeout(resolve, 300); });
        return { settled: true };
      },
    });
    const client = new MeshClient(BROKER, { agentId: 'NodeShop' });
    try {
      const failed = await client.request('NodeCardAgent', { action: 'charge' });
      assert.equal(failed.type, 'ERROR');
      assert.equal(failed.content.error, 'card declined');
      assert.equal(failed.from, 'NodeCardAgent');

      const slow = client.request('NodeCardAgent', { action: 'settle' });
      await entered;
      await agent.stop(); // while the handler runs: it finishes and its answer goes out
      const settled = await slow;
      assert.equal(settled.type, 'RESPONSE');
      assert.deepEqual(settled.content, { action: 'settle', settled: true });
      const left = await client.listAgents();
      assert.ok(!left.some((a) => a.agentId === 'NodeCardAgent'));
    } finally {
      client.close();
    }
  });

test('an answer JSON cannot carry reaches the requester as an ERROR at once, saying why',
  async () => {
    // A NaN went out and the broker refused the frame (nobody could tell the requester); a
    // BigInt, a Map or a circular answer failed to encode and the request was redelivered
    // until dead-lettered; content nested past what a frame may hold ended the session.
    // Each requester waited out its deadline. Now each hears why at once.
    const circular = {};
    circular.self = circular;
    let deep = {};
    const root = deep;
    for (let i = 0; i < 40; i += 1) { deep.n = {}; deep = deep.n; }
    const answers = { nan: { x: NaN }, inf: { x: [1, -Infinity] }, bigint: { x: 10n },
      map: { m: new Map() }, circular, deep: root, lone: { name: 'caf\udce9' },
      fine: { ok: true } };
    let calls = 0;
    const agent = await serveAgent({ broker: BROKER, agentId: 'NodeOddAgent',
      handler: async (message) => { calls += 1; return answers[message.content.action]; } });
    const client = new MeshClient(BROKER, { agentId: 'NodeOddCaller' });
    try {
      const said = {};
      for (const action of Object.keys(answers)) {
        const answer = await client.request('NodeOddAgent', { action }, { timeoutMs: 5000 });
        said[action] = answer.type === 'ERROR' ? answer.content.error : answer.content;
      }
      const refused = "NodeOddAgent's answer was refused: content: ";
      assert.equal(said.nan, `${refused}NaN is not a number JSON can write (NaN and Infinity are not)`);
      assert.equal(said.inf, `${refused}-Infinity is not a number JSON can write (NaN and Infinity are not)`);
      assert.match(said.bigint, /the BigInt 10 cannot travel as a JSON number/);
      assert.match(said.map, /a Map is not a JSON value/);
      assert.equal(said.circular, `${refused}JSON content may nest at most 25 levels deep (is it circular?)`);
      assert.equal(said.deep, said.circular);
      assert.equal(said.lone, `${refused}a string, "caf\\udce9", is not text UTF-8 can write `
        + '(it holds a lone surrogate)');
      assert.deepEqual(said.fine, { action: 'fine', ok: true });
      assert.equal(calls, 8); // (each handled once: none redelivered)
      // The same content is the caller's mistake when sent: a TypeError, nothing sent.
      await assert.rejects(client.send('NodeOddAgent', { action: 'x', r: root }),
        (err) => err instanceof TypeError && /nest at most 25 levels/.test(err.message));
      await assert.rejects(client.send('NodeOddAgent', { action: 'x', n: NaN }),
        (err) => err instanceof TypeError && /NaN is not a number JSON can write/.test(err.message));
      // A lone surrogate went out as bad UTF-8, and the broker refused its frame whole: every
      // request of the same batch frame with it. Now it is refused alone, before it is sent.
      const [bad, good] = await Promise.allSettled([
        client.request('NodeOddAgent', { action: 'fine', note: 'a\ud800' }, { timeoutMs: 5000 }),
        client.request('NodeOddAgent', { action: 'fine' }, { timeoutMs: 5000 })]);
      assert.ok(bad.status === 'rejected' && bad.reason instanceof TypeError, String(bad.reason));
      assert.match(bad.reason.message, /is not text UTF-8 can write/);
      assert.deepEqual(good.value.content, { action: 'fine', ok: true });
      await assert.rejects(client.send('Node\udfffAgent', { action: 'x' }),
        (err) => err instanceof TypeError && err.message.startsWith('to, "Node\\udfffAgent", is not'));
    } finally {
      client.close();
      await agent.stop();
    }
  });

test('a handler that throws Reject sends the message to the dead-letter queue at once',
  async () => {
    const seen = [];
    const agent = await serveAgent({
      broker: BROKER, agentId: 'NodeInvoiceAgent',
      handler: async (message) => {
        seen.push(message.messageId);
        if (message.content.action !== 'invoice') {
          throw new Reject(`NodeInvoiceAgent does not handle ${message.content.action}`);
        }
        return { invoiced: true };
      },
    });
    const client = new MeshClient(BROKER, { agentId: 'NodeShop' });
    try {
      const sent = await client.send('NodeInvoiceAgent',
        { action: 'ship', parameters: { task_description: 'Ship order 7' } }, { type: 'HANDOFF' });
      let dead = [];
      for (let i = 0; i < 100 && dead.length === 0; i += 1) {
        dead = await client.deadLetters('NodeInvoiceAgent');
        if (dead.length === 0) await new Promise((resolve) => { setTimeout(resolve, 20); });
      }
      assert.equal(dead.length, 1);
      assert.equal(dead[0].message.messageId, sent.messageId);
      assert.equal(dead[0].reason, 'NodeInvoiceAgent does not handle ship');
      assert.equal(dead[0].attempts, 1);
      assert.ok(Date.parse(dead[0].deadLetteredAt) > 0);
      assert.deepEqual(seen, [sent.messageId]); // delivered once, not tried again
      const answered = await client.request('NodeInvoiceAgent', { action: 'invoice' });
      assert.deepEqual(answered.content, { action: 'invoice', invoiced: true });
      // Requeued (the agent still cannot ship: dead again, after one more delivery).
      assert.deepEqual(await client.requeueDeadLetters('NodeInvoiceAgent'),
        { requeued: 1, left: 0 });
      const shipped = () => seen.filter((id) => id === sent.messageId).length;
      for (let i = 0; i < 100 && shipped() < 2; i += 1) {
        await new Promise((resolve) => { setTimeout(resolve, 20); });
      }
      assert.equal(shipped(), 2);
      dead = [];
      for (let i = 0; i < 100 && dead.length === 0; i += 1) {
        dead = await client.deadLetters('NodeInvoiceAgent');
        if (dead.length === 0) await new Promise((resolve) => { setTimeout(resolve, 20); });
      }
      assert.deepEqual(dead.map((d) => d.message.messageId), [sent.messageId]);
    } finally {
      await agent.stop();
      client.close();
    }
  });

test('a handler that throws RetryLater has the message again then, taking the next meanwhile',
  async () => {
    assert.throws(() => new RetryLater(0), RangeError);
    assert.throws(() => new RetryLater(Number.NaN), RangeError);
    for (const deliveryMode of ['PULL', 'PUSH']) {
      const agentId = `NodePacking${deliveryMode}`;
      const seen = [];
      const most = new Set();
      const agent = await serveAgent({
        broker: BROKER, agentId, deliveryMode, maxInFlight: 1,
        handler: async (message, { attempt, maxDeliveryAttempts }) => {
          const { order } = message.content.parameters;
          seen.push([order, attempt]);
          most.add(maxDeliveryAttempts);
          if (order === 'o1' && attempt === 1) throw new RetryLater(1000, 'o1 is not packed yet');
          return null;
        },
      });
      const client = new MeshClient(BROKER, { agentId: `NodeStore${deliveryMode}` });
      try {
        for (const order of ['o1', 'o2']) {
          await client.send(agentId, { action: 'pack', parameters: { task_description: order, order } },
            { type: 'HANDOFF' });
        }
        for (let i = 0; i < 200 && seen.length < 3; i += 1) {
          await new Promise((resolve) => { setTimeout(resolve, 25); });
        }
        // o2 went while o1 waited (a plain failure holds its place: o1 would have come first).
        assert.deepEqual(seen, [['o1', 1], ['o2', 1], ['o1', 2]], deliveryMode);
        assert.deepEqual([...most], [4], deliveryMode); // (the broker's, said by push too)
        assert.deepEqual(await client.deadLetters(agentId), []);
        if (deliveryMode === 'PUSH') {
          // Called directly, the agent says so: UNAVAILABLE, RETRY_LATER, the wait asked.
          const direct = new AgentClient(agent.address, { agentId: 'NodeStorePUSH' });
          try {
            await assert.rejects(direct.handle(agentId,
              { action: 'pack', parameters: { order: 'o1' } }),
            (err) => err instanceof MeshError && err.codeName === 'UNAVAILABLE'
              && err.reason === 'RETRY_LATER' && err.retryAfterMs === 1000
              && err.message.includes('o1 is not packed yet'));
          } finally {
            direct.close();
          }
        }
      } finally {
        await agent.stop();
        client.close();
      }
    }
  });

test('a handler that throws on a hand-off has it back after RT-011 backoff, then dead-letters it',
  async () => {
    const tries = { post: [], wreck: [] };
    const agent = await serveAgent({
      broker: BROKER, agentId: 'NodeLedger',
      handler: async (message) => {
        const task = message.content.parameters.task_description;
        tries[task].push(performance.now());
        if (task === 'wreck' || tries.post.length < 3) throw new Error('the ledger is locked');
        return null;
      },
    });
    const client = new MeshClient(BROKER, { agentId: 'NodeBookkeeper' });
    const gaps = (task) => tries[task].slice(1).map((at, i) => at - tries[task][i]);
    const until = async (done) => {
      for (let i = 0; i < 400 && !(await done()); i += 1) {
        await new Promise((resolve) => { setTimeout(resolve, 50); });
      }
    };
    try {
      const handOff = (task) => client.send('NodeLedger',
        { action: 'execute_handoff', parameters: { task_description: task } }, { type: 'HANDOFF' });
      await handOff('post');
      await until(() => tries.post.length >= 3);
      const [first, second] = gaps('post');
      assert.ok(first >= 99 && second >= 499, `waited ${first} and ${second} ms`);
      const wrecked = await handOff('wreck');
      let dead = [];
      await until(async () => { dead = await client.deadLetters('NodeLedger'); return dead.length; });
      assert.deepEqual(dead.map((d) => [d.message.messageId, d.reason, d.attempts]),
        [[wrecked.messageId, 'nacked after 4 delivery attempts', 4]]);
      const waited = gaps('wreck');
      assert.ok(waited[0] >= 99 && waited[1] >= 499 && waited[2] >= 1999, `waited ${waited}`);
    } finally {
      await agent.stop();
      await client.deregister('NodeLedger').catch(() => {});
      client.close();
    }
  });

test('listings longer than one answer come whole, page by page: agents, dead letters, insights',
  async () => {
    // 110 agents of 128 capabilities of 250 characters: about 3.6 MB, past the 3 MiB a page
    // of ListAgents holds.
    const client = new MeshClient(BROKER, { agentId: 'NodeCatalog' });
    const ids = Array.from({ length: 110 }, (_, i) => `NodeWideAgent${String(i).padStart(3, '0')}`);
    const capabilities = Array.from({ length: 128 }, (_, i) => `${i}-`.padEnd(250, 'c'));
    const seen = [];
    let agent;
    try {
      for (const agentId of ids) {
        await client.register({ agentId, agentTypes: ['node-wide'], capabilities });
      }
      const first = await new Promise((resolve, reject) => {
        client.broker.ListAgents({ agent_type: 'node-wide' }, new grpc.Metadata(),
          (err, res) => (err ? reject(err) : resolve(res)));
      });
      assert.ok(first.agents.length < ids.length, 'the first page holds only part');
      assert.equal(first.next_page_token, first.agents[first.agents.length - 1].agent_id);
      const wide = await client.listAgents('node-wide');
      assert.deepEqual(wide.map((a) => a.agentId), ids);
      assert.equal(wide[109].capabilities.length, 128);
      assert.deepEqual((await client.listAgents()).filter((a) => ids.includes(a.agentId))
        .map((a) => a.agentId), ids);

      // Four dead letters of about 900 kB: three to a page.
      agent = await serveAgent({
        broker: BROKER, agentId: 'NodeArchiveAgent',
        handler: async (message) => {
          seen.push(message.messageId);
          throw new Reject('NodeArchiveAgent keeps nothing this large');
        },
      });
      const sent = [];
      for (let i = 0; i < 4; i += 1) {
        sent.push((await client.send('NodeArchiveAgent',
          { action: 'archive',
            parameters: { task_description: 'Archive', blob: `${i}`.padEnd(900000, 'x') } },
          { type: 'HANDOFF' })).messageId);
      }
      let dead = [];
      for (let i = 0; i < 200 && dead.length < 4; i += 1) {
        dead = await client.deadLetters('NodeArchiveAgent');
        if (dead.length < 4) await new Promise((resolve) => { setTimeout(resolve, 25); });
      }
      assert.deepEqual(dead.map((d) => d.message.messageId), sent);
      assert.equal(dead[3].message.content.parameters.blob.length, 900000);

      // 75 insights of 60 kB, most important first, over two answers.
      const written = [];
      for (let i = 0; i < 75; i += 1) {
        written.push((await client.writeInsight({ n: i, text: 'x'.repeat(60000) },
          { tags: ['node-wide'], importance: i / 100 })).insightId);
      }
      const read = await client.readInsights({ tags: ['node-wide'] });
      assert.deepEqual(read.map((insight) => insight.insightId), written.reverse());
      assert.deepEqual(read[0].content, { n: 74, text: 'x'.repeat(60000) });
    } finally {
      await client.deleteInsights({ tags: ['node-wide'] }).catch(() => {});
      if (agent) await agent.stop();
      for (const agentId of ids) await client.deregister(agentId).catch(() => {});
      client.close();
    }
  });

test('what a session is sent while it closes goes back to the queue as never delivered',
  async () => {
    const client = new MeshClient(BROKER, { agentId: 'NodeShop' });
    try {
      await client.register({ agentId: 'NodeQueueAgent' });
      for (let i = 0; i < 3; i += 1) {
        await client.send('NodeQueueAgent', { action: 'work', parameters: { i } });
      }
      let release;
      const holding = new Promise((resolve) => { release = resolve; });
      let entered;
      const first = new Promise((resolve) => { entered = resolve; });
      const handled = [];
      const session = client.session(async (message, attempt) => {
        handled.push([message.content.parameters.i, attempt]);
        entered();
        await holding;
        return null;
      }, { agentId: 'NodeQueueAgent', maxInFlight: 1 });
      await first;
      const closing = session.close();
      release(); // its ack frees the slot: the next delivery comes while the session closes
      await closing;
      const rest = [];
      let done;
      const all = new Promise((resolve) => { done = resolve; });
      const again = client.session(async (message, attempt) => {
        rest.push([message.content.parameters.i, attempt]);
        if (rest.length === 2) done();
        return null;
      }, { agentId: 'NodeQueueAgent', maxInFlight: 1 });
      await all;
      await again.close();
      assert.deepEqual(handled, [[0, 1]]);
      assert.deepEqual(rest, [[1, 1], [2, 1]]); // each at its first attempt
    } finally {
      await client.deregister('NodeQueueAgent').catch(() => {});
      client.close();
    }
  });

test('a handler slower than its lease runs once: the session extends the lease', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeSlowBoss' });
  try {
    await client.register({ agentId: 'NodeSlowAgent' });
    const sent = await client.send('NodeSlowAgent', { action: 'work' });
    const runs = [];
    let done;
    const finished = new Promise((resolve) => { done = resolve; });
    const session = client.session(async (message, attempt) => {
      runs.push([message.messageId, attempt]);
      await new Promise((resolve) => { setTimeout(resolve, 2500); });
      done();
      return null;
    }, { agentId: 'NodeSlowAgent', leaseMs: 900 });
    await finished;
    await new Promise((resolve) => { setTimeout(resolve, 300); });
    await session.close();
    assert.deepEqual(runs, [[sent.messageId, 1]]); // three leases long, and run once
    const [slow] = (await client.queueStats('NodeSlowAgent')).agents;
    assert.equal(slow.depth + slow.inFlight + slow.deadLetters, 0);
  } finally {
    await client.deregister('NodeSlowAgent').catch(() => {});
    client.close();
  }
});

test('serveAgent takes leaseMs: a handler three leases long answers once', async () => {
  const runs = { kept: 0, unkept: 0 };
  const slow = (name) => async () => {
    runs[name] += 1;
    await new Promise((resolve) => { setTimeout(resolve, 2100); });
    return { runs: runs[name] };
  };
  const kept = await serveAgent({ broker: BROKER, agentId: 'NodeSlowKept', leaseMs: 700,
    handler: slow('kept') });
  // Without extensions, the 700 ms lease ends while the handler works: delivered again.
  const unkept = await serveAgent({ broker: BROKER, agentId: 'NodeSlowUnkept', leaseMs: 700,
    maxLeaseExtensionMs: 0, handler: slow('unkept') });
  const client = new MeshClient(BROKER, { agentId: 'NodeSlowCaller' });
  try {
    const [answer] = await Promise.all([
      client.request('NodeSlowKept', { action: 'work' }, { timeoutMs: 8000 }),
      client.request('NodeSlowUnkept', { action: 'work' }, { timeoutMs: 8000 }),
    ]);
    assert.equal(answer.content.runs, 1);
    await new Promise((resolve) => { setTimeout(resolve, 300); });
    assert.equal(runs.kept, 1);
    assert.ok(runs.unkept >= 2, `runs without extensions: ${runs.unkept}`);
  } finally {
    await kept.stop();
    await unkept.stop();
    client.close();
  }
});

test('a handler hears through its signal that the requester gave up', async () => {
  const seen = [];
  const waitAbort = (name, signal) => new Promise((resolve) => {
    seen.push(`${name} started`);
    signal.addEventListener('abort', () => {
      seen.push(`${name} aborted: ${signal.reason.reason}`);
      resolve(null);
    });
  });
  const agent = await serveAgent({ broker: BROKER, agentId: 'NodeThinker',
    handler: (message, { signal }) => waitAbort('served', signal) });
  const client = new MeshClient(BROKER, { agentId: 'NodeAsker' });
  await client.register({ agentId: 'NodePlainThinker' });
  const subscription = client.subscribe((message, attempt, { signal }) => waitAbort('plain', signal),
    { agentId: 'NodePlainThinker' });
  try {
    // (the Subscribe stream says nothing when it starts: the broker's figures do)
    for (let waited = 0; waited < 5000; waited += 50) {
      const [view] = (await client.queueStats('NodePlainThinker')).agents;
      if (view.subscribers) break;
      await new Promise((resolve) => { setTimeout(resolve, 50); });
    }
    for (const to of ['NodeThinker', 'NodePlainThinker']) {
      await assert.rejects(client.request(to, { action: 'think' }, { timeoutMs: 500 }),
        (err) => err.codeName === 'DEADLINE_EXCEEDED');
    }
    for (let waited = 0; seen.length < 4 && waited < 5000; waited += 50) {
      await new Promise((resolve) => { setTimeout(resolve, 50); });
    }
    // (each agent's own order; the two streams' frames may cross)
    assert.deepEqual([...seen].sort(), ['plain aborted: WITHDRAWN', 'plain started',
      'served aborted: WITHDRAWN', 'served started']);
    assert.ok(seen.indexOf('served started') < seen.indexOf('served aborted: WITHDRAWN'));
    assert.ok(seen.indexOf('plain started') < seen.indexOf('plain aborted: WITHDRAWN'));
    const { agents, totals } = await client.queueStats();
    for (const view of agents.filter((a) => a.agentId.endsWith('Thinker'))) {
      assert.equal(view.depth + view.inFlight + view.deadLetters, 0, view.agentId);
    }
    assert.ok(Number(totals.withdrawnCount) >= 2, `withdrawn: ${totals.withdrawnCount}`);
  } finally {
    subscription.cancel();
    await client.deregister('NodePlainThinker').catch(() => {});
    await agent.stop();
    client.close();
  }
});

test('a handler that passes on its signal gives up what it asked when its requester does',
  async () => {
    const seen = [];
    const thinker = await serveAgent({ broker: BROKER, agentId: 'NodeDeepThinker',
      handler: (message, { signal }) => new Promise((resolve) => {
        seen.push('thinker started');
        signal.addEventListener('abort', () => { seen.push('thinker aborted'); resolve(null); });
      }) });
    const relay = await serveAgent({ broker: BROKER, agentId: 'NodeRelay',
      handler: async (message, { signal, client: asker }) => {
        assert.equal(asker.agentId, 'NodeRelay'); // the agent's own client
        try {
          const answer = await asker.request('NodeDeepThinker', { action: 'think' },
            { timeoutMs: 30000, signal });
          return answer.content;
        } catch (err) {
          seen.push(`relay gave up: ${err.reason}`);
          throw err;
        }
      } });
    const client = new MeshClient(BROKER, { agentId: 'NodeChainAsker' });
    try {
      await assert.rejects(client.request('NodeRelay', { action: 'think' }, { timeoutMs: 600 }),
        (err) => err.codeName === 'DEADLINE_EXCEEDED');
      for (let waited = 0; seen.length < 3 && waited < 5000; waited += 50) {
        await new Promise((resolve) => { setTimeout(resolve, 50); });
      }
      assert.deepEqual(seen, ['thinker started', 'relay gave up: WITHDRAWN', 'thinker aborted']);
      // A gather given up on its way: the copy its agent works on is withdrawn.
      seen.length = 0;
      const stopping = new AbortController();
      const gathering = client.gather({ action: 'think' },
        { agentIds: ['NodeDeepThinker'], timeoutMs: 30000, signal: stopping.signal });
      for (let waited = 0; seen.length < 1 && waited < 5000; waited += 20) {
        await new Promise((resolve) => { setTimeout(resolve, 20); });
      }
      stopping.abort(new Error('enough'));
      await assert.rejects(gathering, /enough/);
      for (let waited = 0; seen.length < 2 && waited < 5000; waited += 50) {
        await new Promise((resolve) => { setTimeout(resolve, 50); });
      }
      assert.deepEqual(seen, ['thinker started', 'thinker aborted']);
      // A direct call to the agent's own server whose caller gives up (its deadline) too.
      seen.length = 0;
      const direct = new AgentClient(thinker.address, { agentId: 'NodeChainAsker' });
      try {
        await assert.rejects(direct.handle('NodeDeepThinker', { action: 'think' },
          { type: 'REQUEST', timeoutMs: 300 }), (err) => err.codeName === 'DEADLINE_EXCEEDED');
      } finally {
        direct.close();
      }
      for (let waited = 0; seen.length < 2 && waited < 5000; waited += 50) {
        await new Promise((resolve) => { setTimeout(resolve, 50); });
      }
      assert.deepEqual(seen, ['thinker started', 'thinker aborted']);
      // An aborted signal gives them up before they start.
      const aborted = AbortSignal.abort(new Error('not wanted'));
      await assert.rejects(client.gather({ action: 'think' },
        { agentIds: ['NodeDeepThinker'], signal: aborted }), /not wanted/);
      await assert.rejects(client.request('NodeDeepThinker', { action: 'think' },
        { signal: aborted }), /not wanted/);
    } finally {
      await relay.stop();
      await thinker.stop();
      client.close();
    }
  });

/** Sends `count` work messages ({action: 'work', parameters: {i}}) to agentId, in order. */
async function sendWork(client, agentId, count) {
  for (let i = 0; i < count; i += 1) {
    await client.send(agentId, { action: 'work', parameters: { i } });
  }
}

/**
 * A session of agentId that handles work messages: `handled` lists their i's as they come,
 * and `all` resolves once `count` were handled.
 */
function handleWork(client, agentId, count, options) {
  const handled = [];
  let done;
  const all = new Promise((resolve) => { done = resolve; });
  const session = client.session(async (message) => {
    handled.push(message.content.parameters.i);
    if (handled.length === count) done();
    return null;
  }, { agentId, ...options });
  return { session, handled, all };
}

/** The ack frames the session writes from now on, as the number of ids in each. */
function ackFrames(session) {
  const acked = [];
  const write = session.write.bind(session);
  session.write = (frame) => { // (a frame, or the frames of one moment in a batch frame)
    for (const each of frame.batch ? frame.batch.frames : [frame]) {
      if (each.ack) acked.push(each.ack.message_ids.length);
    }
    return write(frame);
  };
  return acked;
}

test('a Node agent forwards a request: the next agent, Node or Python, answers the requester',
  async () => {
    const handled = [];
    const expert = await serveAgent({ broker: BROKER, agentId: 'NodeExpert',
      handler: async (message) => ({ by: 'NodeExpert', path: message.content.path,
        replyTo: message.replyTo }) });
    const desk = await serveAgent({ broker: BROKER, agentId: 'NodeDesk', leaseMs: 500,
      handler: async (message, { forward }) => {
        handled.push(message.messageId);
        const content = { ...message.content, path: ['NodeDesk'] };
        const next = { score: 'PriceAgent', lost: 'NodeNowhere' }[message.content.action];
        return forward(next || 'NodeExpert', content);
      } });
    const client = new MeshClient(BROKER, { agentId: 'NodeAsker' });
    const direct = new AgentClient(desk.address, { agentId: 'NodeCaller' });
    try {
      const answer = await client.request('NodeDesk', { action: 'ask' },
        { messageId: 'node-forward-1', timeoutMs: 5000 });
      assert.equal(answer.type, 'RESPONSE');
      assert.equal(answer.from, 'NodeExpert');
      assert.equal(answer.to, 'NodeAsker');
      assert.equal(answer.correlationId, 'node-forward-1');
      assert.deepEqual(answer.content, { action: 'ask', by: 'NodeExpert', path: ['NodeDesk'],
        replyTo: 'NodeAsker' });
      const scored = await client.request('NodeDesk',
        { action: 'score', query: 'Hotel in Paris near Eiffel Tower' }, { timeoutMs: 5000 });
      assert.equal(scored.from, 'PriceAgent');
      assert.equal(scored.content.dimension, 'price');
      const called = await direct.handle('NodeDesk', { action: 'ask' });
      assert.equal(called.type, 'RESPONSE');
      assert.equal(called.from, 'NodeExpert');
      assert.equal(called.to, 'NodeCaller');
      // A forward the broker refuses: the requester hears why at once, not at its deadline.
      const lost = await client.request('NodeDesk', { action: 'lost' }, { timeoutMs: 20000 });
      assert.equal(lost.type, 'ERROR');
      assert.equal(lost.from, 'NodeDesk');
      assert.equal(lost.content.reason, 'AGENT_NOT_FOUND');
      assert.match(lost.content.error, /^NodeDesk could not hand the request on to NodeNowhere: /);
      // The desk is done with what it forwarded: acknowledged, not delivered again once its
      // lease is over.
      await new Promise((resolve) => { setTimeout(resolve, 1500); });
      assert.equal(handled[0], 'node-forward-1');
      assert.equal(handled.length, 4); // three requests through the broker, the direct call
      const [view] = (await client.queueStats('NodeDesk')).agents;
      assert.equal(view.depth + view.inFlight + view.deadLetters, 0);
    } finally {
      direct.close();
      client.close();
      await desk.stop();
      await expert.stop();
    }
  });

test('a wait that is no finite, non-negative number is refused before anything is sent',
  async () => {
    const client = new MeshClient(BROKER, { agentId: 'NodeImpatient' });
    const gateway = new GatewayClient(GATEWAY);
    const direct = new AgentClient((await client.listAgents()).find((a) => a.agentId
      === 'PriceAgent').address, { agentId: 'NodeImpatient' });
    try {
      await client.register({ agentId: 'NodeWaitDesk' });
      const refused = (err) => err instanceof TypeError
        && /timeoutMs must be a finite number of milliseconds, not negative/.test(err.message);
      for (const timeoutMs of [NaN, -5, Infinity, '100']) {
        await assert.rejects(client.request('NodeWaitDesk', { action: 'a' }, { timeoutMs }),
          refused);
        await assert.rejects(client.gather({ action: 'a' }, { agentIds: ['NodeWaitDesk'],
          timeoutMs }), refused);
        await assert.rejects(client.callTool('web_search', { query: 'q' }, { timeoutMs }),
          refused);
        await assert.rejects(direct.handle('PriceAgent', { action: 'score' }, { timeoutMs }),
          refused);
        await assert.rejects(gateway.groupChat({ agentIds: ['PriceAgent'], query: 'q',
          timeoutMs }), refused);
      }
      assert.deepEqual(await client.receive('NodeWaitDesk'), []); // nothing was sent
      // A subscription's lengths and windows, before it opens: the broker's refusal of its
      // frame ended it with nobody told (an agent served so never had a message).
      const bad = /must be a (finite|whole) number/;
      assert.throws(() => client.subscribe(() => null, { agentId: 'NodeWaitDesk', leaseMs: NaN }),
        bad);
      assert.throws(() => client.subscribe(() => null, { agentId: 'NodeWaitDesk',
        maxInFlight: -1 }), bad);
      assert.throws(() => client.session(() => null, { agentId: 'NodeWaitDesk', maxBatch: 1.5 }),
        bad);
      await assert.rejects(serveAgent({ broker: BROKER, agentId: 'NodeWaitAgent',
        handler: async () => ({}), leaseMs: -5 }), bad);
      await assert.rejects(client.writeInsight('x', { ttlMs: NaN }), bad);
      assert.ok(!(await client.listAgents()).some((a) => a.agentId === 'NodeWaitAgent'));
    } finally {
      await client.deregister('NodeWaitDesk').catch(() => {});
      direct.close();
      gateway.close();
      client.close();
    }
  });

test('a closed client says so on every call, a MeshError like every other', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeClosing' });
  await client.register();
  await client.deregister('NodeClosing');
  client.close();
  const gateway = new GatewayClient(GATEWAY);
  gateway.close();
  const closed = (err) => err instanceof MeshError && err.codeName === 'CANCELLED'
    && err.reason === 'SESSION_CLOSED' && /this client is closed/.test(err.message);
  await assert.rejects(client.send('NodeClosing', { action: 'a' }), closed);
  await assert.rejects(client.request('NodeClosing', { action: 'a' }, { timeoutMs: 500 }), closed);
  await assert.rejects(client.register(), closed);
  await assert.rejects(client.queueStats(), closed);
  assert.throws(() => client.session(() => null), closed);
  assert.throws(() => client.subscribe(() => null), closed);
  await assert.rejects(gateway.groupChat({ agentIds: ['PriceAgent'], query: 'q' }), closed);
  client.close(); // again: harmless
});

test('a session acks the deliveries of one frame in one frame, and none is redelivered',
  async () => {
    const client = new MeshClient(BROKER, { agentId: 'NodeBatchShop' });
    try {
      await client.register({ agentId: 'NodeBatchAgent' });
      await sendWork(client, 'NodeBatchAgent', 10);
      const { session, handled, all } = handleWork(client, 'NodeBatchAgent', 10,
        { maxInFlight: 16, maxBatch: 16 });
      const acked = ackFrames(session);
      await all;
      await session.close();
      assert.deepEqual(handled, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
      assert.deepEqual(acked, [10]); // the ten came in one frame: their acks went in one
      assert.deepEqual(await client.receive('NodeBatchAgent'), []); // nothing came back
    } finally {
      await client.deregister('NodeBatchAgent').catch(() => {});
      client.close();
    }
  });

test('a steady trickle of acks shares a frame, and closing sends it at once', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeTrickleShop' });
  try {
    await client.register({ agentId: 'NodeTrickleAgent' });
    let handled;
    const session = client.session(async (message) => {
      handled(message.content.parameters.i);
      return null;
    }, { agentId: 'NodeTrickleAgent', maxInFlight: 64, ackLingerMs: 30000 });
    await new Promise((resolve) => { session.once('subscribed', resolve); });
    const acked = ackFrames(session);
    const seen = [];
    for (let i = 0; i < 5; i += 1) { // one at a time: each handled before the next is sent
      const done = new Promise((resolve) => { handled = resolve; });
      await client.send('NodeTrickleAgent', { action: 'work', parameters: { i } });
      seen.push(await done);
      await new Promise((resolve) => { setImmediate(resolve); });
    }
    assert.deepEqual(seen, [0, 1, 2, 3, 4]);
    assert.deepEqual(acked, [1]); // the first went at once; the next four linger together
    await session.close();
    assert.deepEqual(acked, [1, 4]);
    assert.deepEqual(await client.receive('NodeTrickleAgent'), []); // nothing came back
  } finally {
    await client.deregister('NodeTrickleAgent').catch(() => {});
    client.close();
  }
});

test('acks go at once when half the window is outstanding', async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodeWindowShop' });
  try {
    await client.register({ agentId: 'NodeWindowAgent' });
    await sendWork(client, 'NodeWindowAgent', 6);
    const { session, handled, all } = handleWork(client, 'NodeWindowAgent', 6,
      { maxInFlight: 2, maxBatch: 2, ackLingerMs: 30000 });
    // A lingering ack would hold the window for 30 s: give up waiting after 10.
    await Promise.race([all, new Promise((resolve) => { setTimeout(resolve, 10000).unref(); })]);
    await session.close();
    assert.deepEqual(handled, [0, 1, 2, 3, 4, 5]);
  } finally {
    await client.deregister('NodeWindowAgent').catch(() => {});
    client.close();
  }
});

test('shared state: versions, compare-and-set and locks, beside the Python agents', async () => {
  const a = new MeshClient(BROKER, { agentId: 'NodeWriterA' });
  const b = new MeshClient(BROKER, { agentId: 'NodeWriterB' });
  try {
    assert.equal(await a.getState('node/budget'), null);
    const first = await a.putState('node/budget', { left: 100 }, { expectedVersion: 0 });
    assert.equal(first.version, 1);
    assert.equal(first.updatedBy, 'NodeWriterA');
    await assert.rejects(b.putState('node/budget', { left: 1 }, { expectedVersion: 0 }),
      (err) => err.codeName === 'ABORTED');
    const lock = await a.lockState('node/budget', { leaseMs: 5000 });
    await assert.rejects(b.putState('node/budget', { left: 0 }),
      (err) => err.codeName === 'ABORTED' && err.message.includes('locked by NodeWriterA'));
    await assert.rejects(b.lockState('node/budget', { waitMs: 100 }),
      (err) => err.codeName === 'ABORTED');
    const second = await a.putState('node/budget', { left: 80 }, { lock });
    assert.equal(second.version, 2);
    await a.unlockState(lock);
    await assert.rejects(a.unlockState(lock), (err) => err.codeName === 'FAILED_PRECONDITION');
    assert.deepEqual((await b.getState('node/budget')).value, { left: 80 });
    const gone = await b.deleteState('node/budget', { expectedVersion: 2 });
    assert.equal(gone.version, 2);
    assert.equal(await a.getState('node/budget'), null);
    assert.equal(second.expiresAt, null);
    // An entry written with a ttl lapses: read as absent after it, its key free again.
    const brief = await a.putState('node/brief', { hold: true }, { ttlMs: 300 });
    assert.ok(Date.parse(brief.expiresAt) > Date.parse(brief.updatedAt));
    assert.equal((await b.getState('node/brief')).expiresAt, brief.expiresAt);
    await new Promise((resolve) => { setTimeout(resolve, 600); });
    assert.equal(await b.getState('node/brief'), null);
    assert.equal((await b.putState('node/brief', 1, { expectedVersion: 0 })).version, 1);
    await b.deleteState('node/brief');
    await assert.rejects(a.putState('node/brief', 1, { ttlMs: 0 }), TypeError);
    // Listed by prefix in key order, a page at a time; every page walked by stateEntries.
    for (const n of [3, 1, 4, 0, 2]) await a.putState(`node/list/${n}`, { n });
    const page = await b.listState('node/list/', { pageSize: 2 });
    assert.deepEqual(page.entries.map((e) => e.key), ['node/list/0', 'node/list/1']);
    assert.deepEqual(page.entries[1].value, { n: 1 });
    assert.equal(page.entries[1].updatedBy, 'NodeWriterA');
    const next = await b.listState('node/list/', { pageSize: 2, pageToken: page.nextPageToken });
    assert.deepEqual(next.entries.map((e) => e.key), ['node/list/2', 'node/list/3']);
    const walked = [];
    for await (const entry of a.stateEntries('node/list/')) walked.push(entry.key);
    assert.deepEqual(walked, [0, 1, 2, 3, 4].map((n) => `node/list/${n}`));
    await assert.rejects(a.listState('node/list/', { pageToken: 'not one' }),
      (err) => err.codeName === 'INVALID_ARGUMENT' && err.message.includes('page_token'));
    // Watched: the entries there are, then each change as it is made.
    const watch = b.watchState('node/list/', { sendInitial: true });
    const seen = [];
    for (let i = 0; i < 6; i += 1) {
      const { value } = await watch.next();
      seen.push(`${value.kind} ${value.entry ? value.entry.key : '-'}`);
    }
    assert.deepEqual(seen, ['current node/list/0', 'current node/list/1', 'current node/list/2',
      'current node/list/3', 'current node/list/4', 'synced -']);
    await a.putState('node/list/5', { n: 5 });
    await a.deleteState('node/list/0');
    const put = (await watch.next()).value;
    assert.equal(put.kind, 'put');
    assert.deepEqual([put.entry.key, put.entry.value, put.entry.version], ['node/list/5', { n: 5 }, 1]);
    const deleted = (await watch.next()).value;
    assert.deepEqual([deleted.kind, deleted.entry.key], ['delete', 'node/list/0']);
    await watch.return();
    for (const key of [...walked.slice(1), 'node/list/5']) await a.deleteState(key);
    assert.deepEqual((await a.listState('node/list/')).entries, []);
  } finally {
    a.close();
    b.close();
  }
});

test('a resumed watch that fell behind catches up by itself', async () => {
  // 3,000 writes of 8 kB while the watcher reads nothing: more than gRPC holds in flight, so
  // the broker ends the watch 1000 changes behind; with resume the client watches again and
  // tells the latest version of each entry, then 'synced', with no error.
  const writer = new MeshClient(BROKER, { agentId: 'NodeStateWriter' });
  const watcher = new MeshClient(BROKER, { agentId: 'NodeStateWatcher' });
  const keys = [...Array(10).keys()].map((n) => `node/behind/${n}`);
  try {
    const watch = watcher.watchState('node/behind/', { resume: true });
    assert.equal((await watch.next()).value.kind, 'synced');
    const pad = 'x'.repeat(8000);
    for (let n = 0; n < 3000; n += 1) await writer.putState(keys[n % 10], { n, pad });
    await writer.putState('node/behind/gone', 'soon');
    await writer.deleteState('node/behind/gone');
    const versions = new Map();
    for (;;) {
      const { value } = await watch.next();
      if (value.kind === 'synced') break;
      assert.equal(value.kind, 'put', JSON.stringify(value));
      versions.set(value.entry.key, [...(versions.get(value.entry.key) || []),
        value.entry.version]);
    }
    assert.deepEqual([...versions.keys()].sort(), keys); // (node/behind/gone: never told)
    for (const told of versions.values()) {
      assert.deepEqual(told, [...new Set(told)].sort((a, b) => a - b)); // rising
      assert.equal(told[told.length - 1], 300); // and the latest
    }
    const held = [...versions.values()].reduce((sum, told) => sum + told.length, 0) - 10;
    assert.ok(held >= 1000 && held < 3000, `held ${held}`);
    await writer.putState(keys[0], 'after');
    const later = (await watch.next()).value;
    assert.deepEqual([later.kind, later.entry.key, later.entry.version], ['put', keys[0], 301]);
    await watch.return();
  } finally {
    for (const key of keys) await writer.deleteState(key).catch(() => {});
    writer.close();
    watcher.close();
  }
});

test('the shared memory pool: insights written, read, kept for their ttl and deleted',
  async () => {
    const reviewer = new MeshClient(BROKER, { agentId: 'NodeReviewer' });
    try {
      const vote = await reviewer.writeInsight({ vote: 'approve', confidence: 0.9 },
        { tags: ['vote', 'node_p1'], importance: 0.8, segment: 'votes', ttlMs: 300 });
      assert.equal(vote.agentId, 'NodeReviewer');
      assert.equal(vote.ttlMs, 300);
      assert.equal(Date.parse(vote.expiresAt) - Date.parse(vote.createdAt), 300);
      const kept = await reviewer.writeInsight('modify', { tags: ['vote', 'node_p1'],
        importance: 0.5, segment: 'votes', metadata: { proposal_id: 'node_p1' } });
      assert.equal(kept.expiresAt, null);
      const read = await reviewer.readInsights({ tags: ['node_p1'], segment: 'votes' });
      assert.deepEqual(read.map((i) => i.content),
        [{ vote: 'approve', confidence: 0.9 }, 'modify']);
      assert.deepEqual(read[1].metadata, { proposal_id: 'node_p1' });
      const stats = await reviewer.memoryStats();
      assert.equal(stats.tagDistribution.node_p1, 2);
      await new Promise((resolve) => { setTimeout(resolve, 600); });
      assert.deepEqual((await reviewer.readInsights({ tags: ['node_p1'] })).map((i) => i.insightId),
        [kept.insightId]);
      await assert.rejects(reviewer.deleteInsights(),
        (err) => err.codeName === 'INVALID_ARGUMENT');
      assert.equal(await reviewer.deleteInsights({ tags: ['node_p1'], agentId: 'NodeReviewer' }), 1);
      assert.deepEqual(await reviewer.readInsights({ tags: ['node_p1'] }), []);
      assert.equal((await reviewer.memoryStats()).tagDistribution.node_p1, undefined);
    } finally {
      reviewer.close();
    }
  });

test('a Node agent negotiates with a peer directly (RT-011 peer-to-peer)', async () => {
  const proposals = [];
  const seller = await serveAgent({
    broker: BROKER,
    agentId: 'NodeSeller',
    handler: async (message) => {
      proposals.push(message.content.parameters.proposal);
      const { price } = message.content.parameters.proposal;
      return price >= 90 ? { decision: 'accept' } : { decision: 'counter', proposal: { price: 90 } };
    },
  });
  const buyer = new MeshClient(BROKER, { agentId: 'NodeBuyer' });
  try {
    const outcome = await buyer.negotiate(['NodeSeller'], { price: 60, item: 'lamp' });
    assert.equal(outcome.status, 'AGREED');
    assert.deepEqual(outcome.proposal, { price: 90, item: 'lamp' });
    assert.deepEqual(outcome.rounds.map((r) => r.replies[0].decision), ['counter', 'accept']);
    await assert.rejects(buyer.negotiate(['NodeSeller'], { price: 1 }, { rounds: 4 }),
      (err) => err.codeName === 'INVALID_ARGUMENT');
    await assert.rejects(buyer.negotiate(['NobodyHere'], { price: 1 }),
      (err) => err.codeName === 'NOT_FOUND');
    // One peer not registered: the negotiation ends before the other is asked anything.
    await assert.rejects(buyer.negotiate(['NodeSeller', 'NobodyHere'], { price: 2 }),
      (err) => err.codeName === 'NOT_FOUND' && /NobodyHere is not registered/.test(err.message));
    const after = await buyer.negotiate(['NodeSeller'], { price: 95 });
    assert.equal(after.status, 'AGREED');
    assert.deepEqual(proposals.map((p) => p.price), [60, 90, 95]); // never the 2
  } finally {
    buyer.close();
    await seller.stop();
  }
});

test('TLS files that cannot be used are said as the client or server is made, naming them',
  () => {
    const { security, serverCredentials } = require('../lib/mesh');
    const fs = require('node:fs');
    const os = require('node:os');
    const path = require('node:path');
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'agentmesh-tls-'));
    const junk = path.join(dir, 'junk.pem');
    fs.writeFileSync(junk, 'not a certificate\n');
    const missing = path.join(dir, 'missing.pem');
    assert.throws(() => security({ tlsCa: missing }),
      { name: 'TypeError', message: `cannot read ${missing}: ENOENT` });
    assert.throws(() => security({ tlsCa: junk }),
      { name: 'TypeError', message: `the CA ${junk} is not a PEM certificate` });
    assert.throws(() => security({ tlsCa: junk, tlsClientCert: junk }),
      { name: 'TypeError', message: /a certificate needs its key/ });
    assert.throws(() => serverCredentials({ tlsKey: junk }),
      { name: 'TypeError', message: /a certificate needs its key, and a key its certificate/ });
    assert.throws(() => serverCredentials({ tlsCert: junk, tlsKey: junk, tlsCa: '' }),
      { name: 'TypeError',
        message: `${junk} and ${junk} are not a PEM certificate and its private key: `
          + 'the certificate is not PEM' });
    assert.throws(() => serverCredentials({ tlsClientAuth: 'maybe' }),
      { name: 'TypeError', message: 'tlsClientAuth must be require or none, not "maybe"' });
    // Without a certificate a server is plaintext, as a Python agent's is.
    assert.equal(serverCredentials({ tlsCert: '', tlsKey: '' })._isSecure(), false);
  });

test('an agent waits for its broker a number of milliseconds, 0 or more', async () => {
  for (const waitForBrokerMs of [-1, NaN, Infinity, '5']) {
    await assert.rejects(
      serveAgent({ broker: BROKER, agentId: 'NodeNoAgent', handler: () => null, waitForBrokerMs }),
      { name: 'TypeError', message: /^waitForBrokerMs must be 0 or more milliseconds/ });
  }
});

test('an agent\'s health port is a port, 0 for any free one, or -1 for none', async () => {
  for (const healthPort of [70000, 1.5, '7100', -2]) {
    await assert.rejects(
      serveAgent({ broker: BROKER, agentId: 'NodeNoAgent', handler: () => null, healthPort }),
      { name: 'TypeError', message: /^healthPort must be a port, 0 for any free one, or -1/ });
  }
});
