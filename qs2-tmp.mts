import { startProxy, edgeConfig } from '/work/main/test/support/helpers'
import { WebSocket } from 'ws'
import QueryStream from 'pg-query-stream'
const proxy = await startProxy({ pool: { mode: process.env.MODE as any ?? 'transaction', size: 5 } })
const edgepg: any = await import('edgepg' as string)
const client = new edgepg.Client({ ...edgeConfig(proxy.port), webSocketConstructor: WebSocket })
await client.connect()
for (let i = 0; i < 3; i++) {
  const stream = client.query(new QueryStream('SELECT * FROM generate_series(0, 10) num', [], { rowMode: 'array' }))
  const rows: any[] = []
  stream.on('data', (d: any) => rows.push(d))
  await new Promise((resolve, reject) => { stream.on('end', resolve); stream.on('error', reject) })
  console.log(i, rows.length)
}
await client.end(); await proxy.close()
