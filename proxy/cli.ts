#!/usr/bin/env node
import { parseArgs } from 'node:util'
import { createProxy } from './index'
import { parseHostPort } from './address'

const HELP = `edgepg-proxy: relays WebSocket connections from edgepg (or @neondatabase/serverless) to Postgres.

Usage: edgepg-proxy --upstream host:port [--listen [host:]port] [--allow host:port ...]

Options (each also settable by the environment variable shown):
  --upstream host:port        Postgres to relay to (required)               EDGEPG_UPSTREAM
  --listen [host:]port        where to accept WebSockets                    EDGEPG_LISTEN
                              (default 127.0.0.1:8080; use 0.0.0.0:PORT to accept remote clients)
  --allow host:port           another upstream a client may pick with       EDGEPG_ALLOW (comma-separated)
                              /v1?address=host:port; repeatable; exact match
  --max-message-bytes N       largest WebSocket message accepted            EDGEPG_MAX_MESSAGE_BYTES
                              (default 67108864)
  --no-auth-offload           relay the startup untouched: clients           EDGEPG_AUTH_OFFLOAD=false
                              authenticate with Postgres end to end (default: the proxy asks
                              clients for a password and authenticates upstream with md5/SCRAM)
  --allow-insecure-passwords  accept passwords over plain ws:// from         EDGEPG_ALLOW_INSECURE_PASSWORDS=true
                              non-loopback clients (only when TLS ends in front of the proxy)
  -h, --help                  show this help

Routes: /v2 relays to the upstream; /v1?address=host:port relays to that address if it is the
upstream or allowed by --allow, and is refused with HTTP 403 otherwise. Never an open relay.
Logs one JSON line per session (peer, upstream, duration, bytes, outcome) to stdout.
`

function fail(message: string): never {
  process.stderr.write(`edgepg-proxy: ${message}\nRun edgepg-proxy --help for usage.\n`)
  process.exit(2)
}

function parseFlags() {
  try {
    return parseArgs({
      options: {
        upstream: { type: 'string' },
        listen: { type: 'string' },
        allow: { type: 'string', multiple: true },
        'max-message-bytes': { type: 'string' },
        'no-auth-offload': { type: 'boolean' },
        'allow-insecure-passwords': { type: 'boolean' },
        help: { type: 'boolean', short: 'h' },
      },
    }).values
  } catch (err) {
    fail((err as Error).message)
  }
}
const values = parseFlags()
if (values.help) {
  process.stdout.write(HELP)
  process.exit(0)
}

const env = process.env
/** Names where a setting came from (the flag or its environment variable), for error messages. */
const source = (flag: keyof typeof values, variable: string) => (values[flag] !== undefined ? `--${flag}` : variable)
const upstream = values.upstream ?? env.EDGEPG_UPSTREAM ?? fail('--upstream host:port is required (or set EDGEPG_UPSTREAM)')
const allow = values.allow ?? env.EDGEPG_ALLOW?.split(',').filter(Boolean) ?? []
const listenText = values.listen ?? env.EDGEPG_LISTEN ?? '127.0.0.1:8080'
const maxText = values['max-message-bytes'] ?? env.EDGEPG_MAX_MESSAGE_BYTES
const maxMessageBytes = maxText === undefined ? undefined : Number(maxText)
if (maxMessageBytes !== undefined && !(Number.isInteger(maxMessageBytes) && maxMessageBytes > 0)) fail(`${source('max-message-bytes', 'EDGEPG_MAX_MESSAGE_BYTES')} must be a positive integer, got "${maxText}"`)

function address(what: string, text: string, defaultPort?: number) {
  try {
    return parseHostPort(text, defaultPort)
  } catch (err) {
    fail(`${what}: ${(err as Error).message}`)
  }
}
address(source('upstream', 'EDGEPG_UPSTREAM'), upstream)
for (const a of allow) address(source('allow', 'EDGEPG_ALLOW'), a)
const listen = /^\d+$/.test(listenText) ? { host: '127.0.0.1', port: Number(listenText) } : address(source('listen', 'EDGEPG_LISTEN'), listenText, 8080)

function flag(name: 'no-auth-offload' | 'allow-insecure-passwords', variable: string, invert = false): boolean {
  if (values[name]) return true
  const text = env[variable]?.toLowerCase()
  if (text === undefined || text === '') return false
  if (!['true', 'false', '1', '0'].includes(text)) fail(`${variable} must be true or false, got "${env[variable]}"`)
  return (text === 'true' || text === '1') !== invert
}
const authOffload = !flag('no-auth-offload', 'EDGEPG_AUTH_OFFLOAD', true)
const allowInsecurePasswords = flag('allow-insecure-passwords', 'EDGEPG_ALLOW_INSECURE_PASSWORDS')

const proxy = createProxy({ upstream, allow, maxMessageBytes, authOffload, allowInsecurePasswords, log: (entry) => process.stdout.write(JSON.stringify({ time: new Date().toISOString(), ...entry }) + '\n') })
proxy.listen(listen.port, listen.host).then(
  (addr) => process.stdout.write(JSON.stringify({ time: new Date().toISOString(), listening: `${addr.address}:${addr.port}`, upstream }) + '\n'),
  (err) => fail(`cannot listen on ${listenText}: ${err.message}`)
)
for (const signal of ['SIGINT', 'SIGTERM'] as const) process.once(signal, () => proxy.close().then(() => process.exit(0)))
