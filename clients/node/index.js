'use strict';
// Node.js client of pipeshard.v1.CoordinatorService.Generate.
//
//   const { createClient, generate } = require('pipeshard-client');
//   const client = createClient('127.0.0.1:50051');
//   const summary = await generate(client, {
//     messages: [{ role: 'user', content: 'What is the capital of France?' }],
//     params: { max_tokens: 32 },
//   }, (chunk) => process.stdout.write(chunk.text));
//   client.close();
//
// The proto files are loaded at runtime from the repo's proto/ folder; nothing is generated.

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');
const COORDINATOR_PROTO = 'pipeshard/v1/coordinator.proto';

const LOADER_OPTIONS = {
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_ROOT],
};

// FINISH_REASON_* enum names to the lower-case strings the Python client and CLI use.
const FINISH_REASONS = {
  FINISH_REASON_STOP: 'stop',
  FINISH_REASON_LENGTH: 'length',
  FINISH_REASON_CANCELLED: 'cancelled',
  FINISH_REASON_ERROR: 'error',
};

let cachedPackage = null;

/** The loaded pipeshard.v1 package (cached). */
function loadPackage() {
  if (cachedPackage === null) {
    const definition = protoLoader.loadSync(COORDINATOR_PROTO, LOADER_OPTIONS);
    cachedPackage = grpc.loadPackageDefinition(definition).pipeshard.v1;
  }
  return cachedPackage;
}

/** An insecure CoordinatorService client for "HOST:PORT". Call client.close() when done. */
function createClient(address, options = {}) {
  const { CoordinatorService } = loadPackage();
  return new CoordinatorService(address, grpc.credentials.createInsecure(), options);
}

/** Lower-case finish reason ("stop", "length", "cancelled", "error") for an enum name. */
function finishReason(name) {
  return FINISH_REASONS[name] || 'error';
}

/**
 * Streams one Generate call.
 *
 * `request` is a GenerateRequest object (snake_case fields, e.g. {messages, params: {max_tokens}}).
 * `onChunk(chunk)` is called for every TokenChunk ({text, token_ids}).
 * Resolves with the GenerateSummary ({finish_reason, prompt_tokens, completion_tokens, ttft_ms,
 * tok_s, text, error}; finish_reason is the enum name, e.g. "FINISH_REASON_STOP") and
 * `token_ids`, all the generated token ids collected from the chunks.
 * Rejects with the grpc-js error (err.code, err.details) when the call fails.
 * `options.deadline` (Date or ms since epoch) bounds the call; `options.signal` (AbortSignal) cancels it.
 */
function generate(client, request, onChunk, options = {}) {
  return new Promise((resolve, reject) => {
    const callOptions = {};
    if (options.deadline !== undefined) callOptions.deadline = options.deadline;
    const call = client.Generate(request, callOptions);
    const tokenIds = [];
    let summary = null;
    let settled = false;
    const settle = (fn, value) => {
      if (!settled) {
        settled = true;
        fn(value);
      }
    };
    if (options.signal) {
      if (options.signal.aborted) call.cancel();
      else options.signal.addEventListener('abort', () => call.cancel(), { once: true });
    }
    call.on('data', (response) => {
      if (response.event === 'chunk' || (response.chunk && response.event !== 'summary')) {
        const chunk = response.chunk;
        tokenIds.push(...chunk.token_ids);
        if (onChunk) {
          try {
            onChunk(chunk);
          } catch (err) {
            call.cancel();
            settle(reject, err);
          }
        }
      } else if (response.summary) {
        summary = response.summary;
      }
    });
    call.on('error', (err) => settle(reject, err));
    call.on('end', () => {
      if (summary === null) {
        settle(reject, new Error('Generate stream ended without a summary'));
      } else {
        settle(resolve, { ...summary, token_ids: tokenIds });
      }
    });
  });
}

module.exports = {
  createClient,
  generate,
  finishReason,
  loadPackage,
  grpc,
  PROTO_ROOT,
  FINISH_REASONS,
};
