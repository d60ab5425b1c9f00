/** edgepg-proxy's flags and variables as parseConfig reads them: units, and what it says of a flag it does not know. */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { parseConfig, type CliConfig } from '../proxy/config'

const parse = (argv: string[], env: Record<string, string> = {}) => parseConfig(['--upstream', '127.0.0.1:5432', ...argv], env) as CliConfig

test('durations and sizes take units, or bare ms and bytes as before', () => {
  const given = parse(['--pool-timeout', '5s', '--idle-in-transaction-timeout', '2m', '--max-message-bytes', '64MiB', '--sql-max-body', '1.5MB'], { EDGEPG_SHUTDOWN_GRACE: '250ms', EDGEPG_MAX_CLIENT_BUFFER: '1GiB' })
  assert.equal(given.options.pool?.timeoutMs, 5000)
  assert.equal(given.options.pool?.idleInTransactionMs, 120_000)
  assert.equal(given.options.maxMessageBytes, 64 << 20)
  assert.equal(given.options.sql && given.options.sql.maxBodyBytes, 1_500_000)
  assert.equal(given.options.maxClientBufferBytes, 1 << 30)
  assert.equal(given.shutdownGraceMs, 250)
  const bare = parse(['--pool-timeout', '4000', '--max-message-bytes', '1024'])
  assert.equal(bare.options.pool?.timeoutMs, 4000)
  assert.equal(bare.options.maxMessageBytes, 1024)
})

test('a value a setting cannot take is refused, saying what it takes', () => {
  assert.throws(() => parse(['--pool-timeout', '5 parsecs']), /: --pool-timeout must be a duration in ms or with a unit \(500ms, 5s, 2m, 1h\) ≥ 1, got "5 parsecs"$/)
  assert.throws(() => parse([], { EDGEPG_MAX_MESSAGE_BYTES: '2.5' }), /EDGEPG_MAX_MESSAGE_BYTES must be a size in bytes or with a unit \(64KiB, 64MiB, 1GiB, 10MB\) ≥ 1, got "2.5"/)
  assert.throws(() => parse(['--max-sessions', '5s']), /--max-sessions must be an integer ≥ 1, got "5s"/)
})

test('an unknown flag: the nearest known one is offered, and none when nothing is near', () => {
  assert.throws(() => parse(['--upstrem', '127.0.0.1:5432']), /: unknown option --upstrem; did you mean --upstream\?$/)
  assert.throws(() => parse(['--pool-timout', '5s']), /did you mean --pool-timeout\?$/)
  assert.throws(() => parse(['--frobnicate']), /: unknown option --frobnicate$/)
})

test('a variable renamed to the one rule (EDGEPG_ and the flag) is refused with its name now', () => {
  assert.throws(() => parse([], { EDGEPG_REPLICAS: '127.0.0.1:5433' }), /^Error: EDGEPG_REPLICAS is now EDGEPG_REPLICA \(--replica\)/)
  assert.deepEqual(parse([], { EDGEPG_REPLICA: '127.0.0.1:5433,127.0.0.1:5434' }).options.replicas?.addresses, ['127.0.0.1:5433', '127.0.0.1:5434'])
})
