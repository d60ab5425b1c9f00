#!/usr/bin/env node
import { ConfigError, LOG_LEVELS, parseConfig, parseTokenCommand, type LogLevel } from './config'
import { HELP, TOKEN_USAGE } from './settings'
import { mintToken } from './auth/mint'
import { createProxy } from './index'
import { setupAuth } from './auth/setup'
import cluster from 'node:cluster'
import { runPrimary } from './cluster/primary'
import { workerLink } from './cluster/worker'
import { workerPart } from './cluster/parts'
import { formatHostPort } from './upstream/address'

/** Log lines, a JSON object each; those of one event-loop turn leave in one write. */
let unwritten = ''
const writeLog = () => {
  process.stdout.write(unwritten)
  unwritten = ''
}
/** With --workers, which worker logged a line (proxy/cluster/primary.ts numbers them). */
const worker = process.env.EDGEPG_WORKER_INDEX === undefined ? undefined : Number(process.env.EDGEPG_WORKER_INDEX)
/** --log-level (info until the settings are read). */
let least = 0
/** A line whatever --log-level (where the proxy listens: what its supervisors and our tests read). */
const workerField = worker === undefined ? '' : `,"worker":${worker}`
const write = (entry: object) => {
  if (!unwritten) setImmediate(writeLog)
  // (The time and worker written ahead of the entry's own fields, rather than a copy of it made with them: a line per request.)
  const fields = JSON.stringify(entry)
  unwritten += `{"time":"${new Date().toISOString()}"${workerField}${fields.length > 2 ? ',' : ''}${fields.slice(1)}\n`
}
/** A line of `level` (the proxy's own events: warn, kept unless only errors are asked for): written if it weighs at least --log-level. */
const line = (entry: object, level: LogLevel = 'warn') => LOG_LEVELS.indexOf(level) >= least && write(entry)
process.on('exit', () => unwritten && writeLog())
// Lines nobody reads any more (the log's reader went away) are dropped; the proxy goes on.
process.stdout.on('error', () => {})

/** Exits with `message`, then how to run the command that failed. */
function fail(message: string, usage = 'Usage: edgepg-proxy --upstream host:port [--listen [host:]port] [options]; --help lists them'): never {
  process.stderr.write(`edgepg-proxy: ${message}\n${usage}\n`)
  process.exit(2)
}

// `edgepg-proxy setup-auth <database-url> [--neon-compat]`: what a database needs for tokens.
if (process.argv[2] === 'setup-auth') {
  const args = process.argv.slice(3)
  const url = args.find((a) => !a.startsWith('--'))
  const unknown = args.filter((a) => a.startsWith('--') && a !== '--neon-compat')
  const usage = 'Usage: edgepg-proxy setup-auth postgres://<superuser>:<password>@<host>:<port>/<database> [--neon-compat]'
  if (!url || unknown.length) fail(url ? `setup-auth: unknown ${unknown.join(' ')}` : 'setup-auth needs the database URL', usage)
  try {
    process.stdout.write(`${await setupAuth(url, { neonCompat: args.includes('--neon-compat') })}\n`)
    process.exit(0)
  } catch (err) {
    const message = (err as Error).message
    // (pg's words when the URL carries no password and the database asks for one.)
    const why = /client password must be a string/.test(message) ? `the database asks for a password, and ${url.replace(/\/\/[^@/]*@/, '//…@')} has none` : message
    fail(`setup-auth failed: ${why}`, usage)
  }
}

// `edgepg-proxy token --role <role> [--claim name=value ...]`: a token to try tokens with.
if (process.argv[2] === 'token') {
  let mint: ReturnType<typeof parseTokenCommand>
  try {
    mint = parseTokenCommand(process.argv.slice(3), process.env)
  } catch (err) {
    if (err instanceof ConfigError) fail(err.message, TOKEN_USAGE)
    throw err
  }
  process.stdout.write(mint === 'help' ? `${TOKEN_USAGE}\n` : `${await mintToken(mint)}\n`)
  process.exit(0)
}

let parsed: ReturnType<typeof parseConfig>
try {
  parsed = parseConfig(process.argv.slice(2), process.env)
} catch (err) {
  if (err instanceof ConfigError) fail(err.message)
  throw err
}
if (parsed === 'help') {
  process.stdout.write(HELP)
  process.exit(0)
}
const config = parsed
least = LOG_LEVELS.indexOf(config.logLevel)
/** A session or request that did not end well weighs more than one that did. */
const ended = <T extends { kind?: string; status?: number }>(entry: T) => line(entry, (entry.kind ?? 'ok') === 'ok' && (entry.status ?? 200) < 400 ? 'info' : 'warn')

const { listen, adminListen, shutdownGraceMs, readTls, workers } = config
if (workers > 1 && cluster.isPrimary) {
  runPrimary({ workers, log: line, upstreamTls: config.options.upstreamTls })
} else await serve()

/** One proxy: the whole of it, or a worker of --workers n (its part of the limits the workers do not share). */
async function serve() {
  const link = cluster.isWorker ? await workerLink(workers, worker!) : undefined
  const options = link ? workerPart(config.options, workers, worker!) : config.options
  const proxy = createProxy({ ...options, log: ended, sqlLog: (entry) => ended({ route: '/sql', ...entry }), refusalLog: (entry) => line({ upgrade: 'refused', ...entry }), cluster: link })
  link?.report(proxy.metrics.registry)
  proxy.listen(listen.port, listen.host).then(
    (addr) => write({ listening: `${addr.address}:${addr.port}`, upstream: options.upstream, tls: Boolean(options.tls), pid: process.pid }),
    (err) => fail(`cannot listen on ${formatHostPort(listen)}: ${err.message}`)
  )
  if (adminListen) {
    proxy.admin.once('error', (err) => fail(`cannot listen on ${formatHostPort(adminListen)} (--admin-listen): ${err.message}`))
    proxy.admin.listen(adminListen.port, adminListen.host, () => line({ admin: formatHostPort(adminListen), serves: ['/metrics', '/healthz'] }))
  }

  let stopping = false
  const stop = (why: object, handover = false) => {
    if (stopping) return
    stopping = true
    line({ ...why, sessions: proxy.sessionCount, graceMs: shutdownGraceMs })
    proxy.close(shutdownGraceMs, { handover }).then(() => process.exit(0))
  }
  for (const signal of ['SIGINT', 'SIGTERM'] as const) process.on(signal, () => stop({ shutdown: signal }))
  if (link) link.onRetire = () => stop({ handover: 'retiring: the other workers accept meanwhile' }, true)
  process.on('SIGHUP', () => {
    if (!readTls) return line({ reload: 'nothing to reload (no --cert)' })
    try {
      proxy.setTls(readTls())
      line({ reload: 'certificate reloaded' })
    } catch (err) {
      line({ reload: 'failed; keeping the current certificate', error: (err as Error).message }, 'error')
    }
  })
}
