/**
 * `npm start`: PostgreSQL 18 (embedded, data kept in .edgepg/data), edgepg-proxy in front of it,
 * and a SQL console page that runs edgepg in the browser and draws every round trip. Ctrl-C (or
 * SIGTERM) stops all three and exits 0; the data stays for the next start.
 */
import net from 'node:net'
import { dirname, join, relative } from 'node:path'
import { createProxy } from '../proxy/index'
import { OptionsError, PORT_SETTINGS, USAGE, parseOptions, type DemoOptions } from './options'
import { checkNotRunning, startDemoPostgres, SUPERUSER } from './postgres'
import { setupDemoAuth } from './auth'
import { DEMO_ROLE } from './seed'
import { createConsoleServer } from './server'

const HOST = '127.0.0.1'

/** What has been started, newest last; stopped in reverse. */
const running: Array<{ name: string; stop: () => Promise<void> }> = []
let ready = false
let signalled = false
let exiting: Promise<never> | undefined

function exit(code: number): Promise<never> {
  return (exiting ??= (async () => {
    for (const { name, stop } of running.splice(0).reverse()) {
      await stop().catch((err) => {
        console.error(`edgepg demo: stopping ${name} failed: ${(err as Error).message}`)
        code ||= 1
      })
    }
    process.exit(code)
  })())
}

/** Starts one part; if a signal came in meanwhile, stops everything once it is up. */
async function start<T>(name: string, up: Promise<T>, stop: (it: T) => Promise<void>): Promise<T> {
  const it = await up
  running.push({ name, stop: () => stop(it) })
  if (signalled) await exit(0)
  return it
}

function fail(message: string): Promise<never> {
  console.error(`edgepg demo: ${message}`)
  return exit(1)
}

for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
  process.on(signal, () => {
    if (signalled) return
    signalled = true
    console.log(`\n${signal}: stopping (the data stays in place)…`)
    // Before everything is up, start() stops it as soon as the part starting now is running.
    if (ready) void exit(0)
  })
}

/** Fails with a message naming the setting to change when any of the ports is taken. */
async function checkPorts(options: DemoOptions) {
  const names = { port: 'the SQL console', proxyPort: 'edgepg-proxy', pgPort: 'PostgreSQL' } as const
  const keys = Object.keys(names) as Array<keyof typeof names>
  for (const key of keys) {
    const clash = keys.find((other) => other !== key && options[other] === options[key])
    if (clash) throw new Error(`${names[key]} and ${names[clash]} cannot share port ${options[key]}; change one with ${PORT_SETTINGS[key]}`)
    const error = await new Promise<NodeJS.ErrnoException | undefined>((resolve) => {
      const probe = net.createServer()
      probe.once('error', resolve)
      probe.listen(options[key], HOST, () => probe.close(() => resolve(undefined)))
    })
    if (error) {
      const why = error.code === 'EADDRINUSE' ? 'is already in use' : `cannot be used (${error.code ?? error.message})`
      throw new Error(`port ${options[key]} on ${HOST} (for ${names[key]}) ${why}; choose another with ${PORT_SETTINGS[key]}`)
    }
  }
}

async function main() {
  let options
  try {
    options = parseOptions(process.argv.slice(2), process.env)
    if (options === 'help') {
      process.stdout.write(USAGE)
      return exit(0)
    }
  } catch (err) {
    if (err instanceof OptionsError || (err as NodeJS.ErrnoException).code?.startsWith('ERR_PARSE_ARGS')) return fail(`${(err as Error).message}\n${USAGE}`)
    throw err
  }
  checkNotRunning(options.dataDir)
  await checkPorts(options)
  const { port, proxyPort, pgPort, dataDir, verbose } = options
  const shownDir = relative(process.cwd(), dataDir).startsWith('..') ? dataDir : relative(process.cwd(), dataDir) || '.'
  const log = verbose ? (line: string) => console.log(`[postgres] ${line}`) : undefined

  console.log(`edgepg demo: starting PostgreSQL 18 on ${HOST}:${pgPort} (data: ${shownDir})…`)
  const pg = await start('PostgreSQL', startDemoPostgres(dataDir, pgPort, log), (db) => db.stop())
  const consoleOrigins = [`http://${HOST}:${port}`, `http://localhost:${port}`]
  // Signed-in users (users.html): tokens the demo signs, for a role whose password only the proxy reads.
  const { sign, ...tokens } = await setupDemoAuth({ host: HOST, port: pgPort, database: DEMO_ROLE.database, ...SUPERUSER }, join(dirname(dataDir), 'pgpass'))
  const proxy = createProxy({
    upstream: `${HOST}:${pgPort}`,
    tokens,
    allowedOrigins: consoleOrigins, // the console's page opens WebSockets and POSTs /sql with its Origin
    log: verbose ? (entry) => console.log(`[proxy] ${JSON.stringify(entry)}`) : undefined,
  })
  await start('edgepg-proxy', proxy.listen(proxyPort, HOST), () => proxy.close(0))
  const { user, password, database } = DEMO_ROLE
  const web = createConsoleServer({ connection: { host: HOST, port: pgPort, user, password, database }, proxy: { host: HOST, port: proxyPort }, signIn: sign })
  await start('the SQL console', web.listen(port, HOST), () => web.close())

  const state = pg.initialised ? 'new, seeded with a sample shop' : pg.seeded ? 'reused, seeded now' : 'reused'
  console.log(`
  PostgreSQL 18   postgres://${user}:${password}@${HOST}:${pgPort}/${database}   data: ${shownDir} (${state})
  superuser       postgres://${SUPERUSER.user}:${SUPERUSER.password}@${HOST}:${pgPort}/${database}   (for setup-auth, roles, grants)
  edgepg-proxy    ws://${HOST}:${proxyPort}/v2   http://${HOST}:${proxyPort}/sql
  SQL console     http://${HOST}:${port}/
  signed-in users http://${HOST}:${port}/users.html   (no database password in that page: tokens and Row-Level Security)

Open the SQL console in a browser. Ctrl-C stops everything; the data stays for the next start.`)
  ready = true
  if (signalled) await exit(0)
}

main().catch((err) =>
  // Ctrl-C during start-up reaches Postgres too (one process group), failing its start: no error then.
  signalled ? exit(0) : fail(process.env.EDGEPG_DEMO_VERBOSE ? ((err as Error).stack ?? String(err)) : (err as Error).message)
)
