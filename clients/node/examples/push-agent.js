'use strict';
// An agent in plain gRPC, without the agentmesh library: a server of mesh.v1.AgentService
// (HandleMessage, DescribeAgent, NotifyDeregistered) registered with DELIVERY_MODE_PUSH, so
// that the broker calls it with each message queued for the agent. No stream, lease or
// acknowledgement of its own: answering the call settles the delivery, and a RESPONSE it
// returns answers the requester.
//
//   node examples/push-agent.js AGENT_ID [PORT]
//
// serves AGENT_ID against the broker named by AGENTMESH_BROKER (default 127.0.0.1:50051) until
// SIGTERM or Ctrl-C, answering every message with what it was sent.

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const { service: healthService } = require('grpc-health-check');

const definition = protoLoader.loadSync(['mesh/v1/broker.proto', 'mesh/v1/agent.proto'], {
  includeDirs: [path.resolve(__dirname, '..', '..', '..', 'proto')],
  keepCase: true,
  enums: String,
  defaults: true,
});
const { v1 } = grpc.loadPackageDefinition(definition).mesh;

// gRPC's rich error model (google.rpc.Status in the grpc-status-details-bin trailer), the
// part of it this agent sends.
const RPC = protobuf.Root.fromJSON({ nested: { google: { nested: {
  protobuf: { nested: { Any: { fields: {
    type_url: { type: 'string', id: 1 }, value: { type: 'bytes', id: 2 } } } } },
  rpc: { nested: {
    Status: { fields: { code: { type: 'int32', id: 1 }, message: { type: 'string', id: 2 },
      details: { rule: 'repeated', type: 'google.protobuf.Any', id: 3 } } },
    BadRequest: {
      fields: { field_violations: { rule: 'repeated', type: 'FieldViolation', id: 1 } },
      nested: { FieldViolation: { fields: {
        field: { type: 'string', id: 1 }, description: { type: 'string', id: 2 } } } },
    },
  } },
} } } });

// INVALID_ARGUMENT with a field violation on to_agent: "this message is not for the agent I
// serve". The broker reads it as its instance's address having gone to another agent's server
// (a pod's address given to another pod) and keeps the message for an instance of its agent;
// a plain INVALID_ARGUMENT would send it to the dead-letter queue.
function notThisAgent(description) {
  const badRequest = RPC.lookupType('google.rpc.BadRequest')
    .encode({ field_violations: [{ field: 'to_agent', description }] }).finish();
  const status = RPC.lookupType('google.rpc.Status').encode({
    code: grpc.status.INVALID_ARGUMENT,
    message: description,
    details: [{ type_url: 'type.googleapis.com/google.rpc.BadRequest', value: badRequest }],
  }).finish();
  const metadata = new grpc.Metadata();
  metadata.add('grpc-status-details-bin', Buffer.from(status));
  return { code: grpc.status.INVALID_ARGUMENT, details: description, metadata };
}

function call(stub, method, request) {
  return new Promise((resolve, reject) => {
    stub[method](request, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

async function main() {
  const agentId = process.argv[2] || 'PlainNodeAgent';
  const port = Number(process.argv[3] || 0);
  let stopping = false;
  let deregistered = false;
  let watch = null;
  const server = new grpc.Server();
  server.addService(v1.AgentService.service, {
    HandleMessage({ request }, callback) {
      const { message } = request;
      if (message.to_agent !== agentId) {
        callback(notThisAgent(`this server serves ${agentId}, not ${message.to_agent}`));
        return;
      }
      // The broker fills in the envelope of an answer: who it is from and for, and the
      // request it answers.
      callback(null, {
        response: {
          message_type: 'MESSAGE_TYPE_RESPONSE',
          content: {
            fields: {
              action: { stringValue: 'echo' },
              echo: { structValue: message.content },
              served_by: { stringValue: `${agentId} (pid ${process.pid})` },
            },
          },
        },
      });
    },
    DescribeAgent(_, callback) {
      callback(null, { card: { agent_id: agentId, capabilities: ['echo'] } });
    },
    // The broker's notice that the agent was taken off the mesh (agentmesh deregister): it is
    // not registered again behind the back of whoever did it. The server stays until stopped.
    NotifyDeregistered({ request }, callback) {
      callback(null, {});
      if (request.agent_id !== agentId || stopping || deregistered) return;
      deregistered = true;
      watch.cancel();
      console.warn(`${agentId} was deregistered: it takes no more messages`);
    },
  });
  const bound = await new Promise((resolve, reject) => {
    server.bindAsync(`127.0.0.1:${port}`, grpc.ServerCredentials.createInsecure(),
      (err, p) => (err ? reject(err) : resolve(p)));
  });
  const address = `127.0.0.1:${bound}`;
  const brokerAddress = process.env.AGENTMESH_BROKER || '127.0.0.1:50051';
  const broker = new v1.BrokerService(brokerAddress, grpc.credentials.createInsecure());
  const register = () => call(broker, 'RegisterAgent', {
    agent: { agent_id: agentId, address, delivery_mode: 'DELIVERY_MODE_PUSH' },
  });
  await register();
  console.log(`${agentId} serving on ${address}`);
  // Nothing else flows from here to the broker: a watch of its health tells when it went
  // away, and the agent registers again once it is back (a restarted broker may have
  // forgotten it).
  const Health = grpc.makeGenericClientConstructor(healthService, 'Health');
  const health = new Health(brokerAddress, grpc.credentials.createInsecure());
  const keepRegistered = () => {
    watch = health.Watch({ service: '' });
    watch.on('data', () => {});
    watch.on('error', () => setTimeout(() => {
      if (!stopping && !deregistered) register().catch(() => {}).finally(keepRegistered);
    }, 1000));
  };
  keepRegistered();
  const stop = async () => {
    stopping = true;
    watch.cancel();
    // This instance leaves; what is queued for the agent stays for the next one.
    await call(broker, 'DeregisterAgent', { agent_id: agentId, address }).catch(() => {});
    server.tryShutdown(() => process.exit(0));
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
