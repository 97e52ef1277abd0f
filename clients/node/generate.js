#!/usr/bin/env node
'use strict';
// node generate.js --coordinator HOST:PORT [--max-tokens N] [--timeout S] [--json] "prompt"
//
// Sends the prompt as one user chat message and streams the text to stdout; with --json prints
// only one JSON object with the same keys as `pipeshard generate --json`:
// text, token_ids, finish_reason, prompt_tokens, completion_tokens, ttft_ms, tok_s.
// Exit codes: 0 ok, 1 the generation finished with an error, 2 gRPC error or bad usage.

const { parseArgs } = require('util');
const { createClient, generate, finishReason, grpc } = require('./index');

const DEFAULT_COORDINATOR = '127.0.0.1:50051';
const DEFAULT_MAX_TOKENS = 128;
const USAGE =
  'usage: node generate.js --coordinator HOST:PORT [--max-tokens N] [--timeout SECONDS] [--json] "prompt"';

const STATUS_NAMES = Object.fromEntries(
  Object.entries(grpc.status).map(([name, code]) => [code, name]),
);

function fail(message, code = 2) {
  process.stderr.write(`pipeshard generate: ${message}\n`);
  process.exitCode = code;
}

function parse(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      coordinator: { type: 'string', default: DEFAULT_COORDINATOR },
      'max-tokens': { type: 'string', default: String(DEFAULT_MAX_TOKENS) },
      timeout: { type: 'string' },
      json: { type: 'boolean', default: false },
      help: { type: 'boolean', short: 'h', default: false },
    },
  });
  if (values.help) return { help: true };
  if (positionals.length !== 1) throw new Error('expected exactly one prompt argument');
  const maxTokens = Number(values['max-tokens']);
  if (!Number.isInteger(maxTokens)) throw new Error(`--max-tokens must be an integer, got ${values['max-tokens']}`);
  let timeout = null;
  if (values.timeout !== undefined) {
    timeout = Number(values.timeout);
    if (!(timeout > 0)) throw new Error(`--timeout must be a positive number of seconds, got ${values.timeout}`);
  }
  return { coordinator: values.coordinator, maxTokens, timeout, json: values.json, prompt: positionals[0] };
}

async function main() {
  let args;
  try {
    args = parse(process.argv.slice(2));
  } catch (err) {
    fail(`${err.message}\n${USAGE}`);
    return;
  }
  if (args.help) {
    process.stdout.write(`${USAGE}\n`);
    return;
  }

  const request = {
    messages: [{ role: 'user', content: args.prompt }],
    params: { max_tokens: args.maxTokens },
  };
  const options = {};
  if (args.timeout !== null) options.deadline = Date.now() + args.timeout * 1000;
  const onChunk = args.json ? null : (chunk) => process.stdout.write(chunk.text);

  const client = createClient(args.coordinator);
  let summary;
  try {
    summary = await generate(client, request, onChunk, options);
  } catch (err) {
    if (typeof err.code === 'number') {
      fail(`${STATUS_NAMES[err.code] || err.code}: ${err.details || err.message}`);
    } else {
      fail(err.message);
    }
    return;
  } finally {
    client.close();
  }

  const reason = finishReason(summary.finish_reason);
  if (args.json) {
    const result = {
      text: summary.text,
      token_ids: summary.token_ids,
      finish_reason: reason,
      prompt_tokens: summary.prompt_tokens,
      completion_tokens: summary.completion_tokens,
      ttft_ms: summary.ttft_ms,
      tok_s: summary.tok_s,
    };
    process.stdout.write(`${JSON.stringify(result)}\n`);
  } else {
    process.stdout.write('\n');
  }
  if (reason === 'error') fail(`generation failed: ${summary.error || 'unknown error'}`, 1);
}

main();
