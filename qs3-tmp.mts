import { startProxy, edgeConfig } from '/work/main/test/support/helpers'
import { WebSocket } from 'ws'
import QueryStream from 'pg-query-stream'
const proxy = await startProxy({ pool: { mode: 'transaction', size: 1 } })
const edgepg: any = await import('edgepg' as string)
const cfg = { ...edgeConfig(proxy.port), webSocketConstructor: WebSocket }
const a = new edgepg.Client(cfg); await a.connect()
await a.query('CREATE TEMP SEQUENCE IF NOT EXISTS x').catch(() => {})
await a.end()
const setup = new edgepg.Client(cfg); await setup.connect()
await setup.query('CREATE TABLE IF NOT EXISTS qs3_p (id serial primary key)')
await setup.end()
const c1 = new edgepg.Client(cfg); await c1.connect()
const qr = c1.query(new QueryStream('INSERT INTO qs3_p DEFAULT VALUES RETURNING id'))
await new Promise((resolve) => { qr.on('data', () => {}); qr.on('end', resolve) })
await c1.end()
const b = new edgepg.Client(cfg); await b.connect()
const stream = b.query(new QueryStream('SELECT * FROM generate_series(0, 10) num', [], { rowMode: 'array' }))
const rows: any[] = []
stream.on('data', (d: any) => rows.push(d))
await new Promise((resolve, reject) => { stream.on('end', resolve); stream.on('error', reject) })
console.log('rows', rows.length)
await b.end(); await proxy.close()
